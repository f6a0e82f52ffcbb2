# Sourced by scripts/image-check and scripts/wheel-check: a Debian 12 base
# image for podman made from Debian's own packages (no registry is reachable
# on these machines; ../shared/BUILD-NOTES.md).
#
#   debian_base_image PODMAN_ARRAY_NAME IMAGE WORK_DIR
#
# Does nothing when IMAGE exists. Otherwise bootstraps a minbase root file
# system with mmdebstrap from the Debian mirror apt already uses
# (/etc/apt/sources.list.d/debian.sources), close to debian:12-slim: merged
# /usr without the usrmerge package (which pulls in perl), no man pages, docs
# or translations, apt's archives and caches removed after every run (Debian's
# images do this with the same apt.conf.d/docker-clean), and imports it as
# IMAGE. Needs root (mmdebstrap --mode=root). Returns non-zero on failure.
debian_base_image() {
  local -n _podman=$1
  local image=$2 work=$3
  "${_podman[@]}" image exists "$image" && return 0
  local mirror=/etc/apt/sources.list.d/debian.sources
  [[ -f $mirror ]] || mirror=http://deb.debian.org/debian
  local clean='DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache ""; Dir::Cache::srcpkgcache "";'
  mkdir -p "$work"
  mmdebstrap --variant=minbase --mode=root --quiet \
    --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-include=/usr/share/locale/locale.alias' \
    --aptopt='APT::Install-Recommends "false"' \
    --customize-hook="printf '%s\n' '$clean' > \"\$1/etc/apt/apt.conf.d/docker-clean\"; rm -f \"\$1\"/var/cache/apt/*.bin" \
    bookworm "$work/bookworm-slim.tar" "$mirror" || return 1
  "${_podman[@]}" import "$work/bookworm-slim.tar" "$image" >/dev/null || return 1
  rm -f "$work/bookworm-slim.tar"
}
