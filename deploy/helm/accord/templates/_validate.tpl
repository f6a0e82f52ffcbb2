{{/*
Checks for value combinations that values.schema.json cannot express. Every
message names the values involved and how to fix them. Included once, from
coordinator-deployment.yaml.
*/}}
{{- define "accord.validate" -}}
{{- $v := .Values -}}
{{- if and (not $v.tls.enabled) (not $v.tls.allowPlaintext) -}}
{{- fail "tls.enabled=false would run the coordinator and sidecars with --plaintext (job tokens and manifests in clear text). Enable TLS (tls.enabled=true with tls.coordinatorSecret and tls.sidecarSecret), or confirm plaintext with tls.allowPlaintext=true." -}}
{{- end -}}
{{- if and $v.tls.enabled $v.tls.allowPlaintext -}}
{{- fail "tls.allowPlaintext=true only applies with tls.enabled=false; remove tls.allowPlaintext or set tls.enabled=false." -}}
{{- end -}}
{{- if $v.tls.enabled -}}
{{- $_ := required "tls.enabled=true needs tls.coordinatorSecret: the name of a Secret with tls.crt, tls.key and ca.crt for the coordinator (see deploy/README.md, 'TLS')." $v.tls.coordinatorSecret -}}
{{- if $v.trainerExample.enabled -}}
{{- $_ := required "tls.enabled=true with trainerExample.enabled=true needs tls.sidecarSecret: a Secret with tls.crt, tls.key and ca.crt for the sidecar." $v.tls.sidecarSecret -}}
{{- end -}}
{{- end -}}
{{- if $v.auth.enabled -}}
{{- $_ := required "auth.enabled=true needs auth.coordinatorTokensSecret: a Secret whose key `tokens` has lines \"job_id token\"." $v.auth.coordinatorTokensSecret -}}
{{- if $v.trainerExample.enabled -}}
{{- $_ := required "auth.enabled=true with trainerExample.enabled=true needs auth.sidecarTokenSecret: a Secret whose key `token` holds the job's token." $v.auth.sidecarTokenSecret -}}
{{- end -}}
{{- end -}}
{{- if and $v.relay.enabled $v.trainerExample.enabled -}}
{{- if lt (mul (int $v.relay.replicas) (int $v.relay.nodesPerRelay)) (int $v.trainerExample.nodes) -}}
{{- fail (printf "relay.replicas x relay.nodesPerRelay (%d x %d) must cover trainerExample.nodes (%d): trainer pod i dials relay i / nodesPerRelay. Raise relay.replicas." (int $v.relay.replicas) (int $v.relay.nodesPerRelay) (int $v.trainerExample.nodes)) -}}
{{- end -}}
{{- end -}}
{{- if and $v.relay.enabled $v.tls.enabled -}}
{{- $_ := required "relay.enabled=true with tls.enabled=true needs relay.tlsSecret: a Secret with tls.crt, tls.key and ca.crt for the relays (server certificate for *.<release>-relay.<namespace>.svc, also their client certificate towards the coordinator)." $v.relay.tlsSecret -}}
{{- end -}}
{{- $p := $v.coordinator.ports -}}
{{- if or (eq (int $p.grpc) (int $p.metrics)) (eq (int $p.grpc) (int $p.health)) (eq (int $p.metrics) (int $p.health)) -}}
{{- fail (printf "coordinator.ports must be distinct: grpc=%d metrics=%d health=%d." (int $p.grpc) (int $p.metrics) (int $p.health)) -}}
{{- end -}}
{{- end -}}
