"""DeepSpeed ZeRO scenarios for tests/python/test_deepspeed.py.

`run_ds_ranks(fn, world_size, timeout_s, **kwargs)` starts `world_size`
processes (spawn), each calling `deepspeed.init_distributed` on Gloo over a
file store with a short process-group `timeout`, then fn(rank, world_size,
**kwargs). Results, RankFailure, RankDied and RanksTimedOut are those of
harness.py. DS_ACCELERATOR=cpu; the optimizer is torch's AdamW (no DeepSpeed
C++ extension is built).

The model: `embed` and `body` run on every batch; `tower` only on batches
with an image; `head` last. `usage(case, rank, step, micro)` says whether a
rank's microbatch has an image.
"""

import contextlib
import os
import pickle
import sys
import tempfile
import traceback
from datetime import timedelta

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from harness import RankDied, RankFailure, RanksTimedOut  # noqa: E402,F401

IN, HID, IMG = 8, 16, 4
DONE = [0]  # steps this rank finished, reported with a failure


def _entry(fn, rank, world_size, tmpdir, pg_timeout_s, kwargs):
    os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world_size)
    os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = str(rank), str(world_size)
    err = os.open(os.path.join(tmpdir, f"stderr.{rank}"), os.O_WRONLY | os.O_CREAT, 0o644)
    os.dup2(err, 2)
    os.dup2(err, 1)  # DeepSpeed logs to stdout
    import faulthandler

    faulthandler.enable()  # Gloo aborts the process: say where
    out = os.path.join(tmpdir, f"result.{rank}")
    try:
        import torch
        import deepspeed

        torch.set_num_threads(1)
        deepspeed.init_distributed(dist_backend="gloo", init_method=f"file://{tmpdir}/store",
                                   rank=rank, world_size=world_size, verbose=False, auto_mpi_discovery=False,
                                   timeout=timedelta(seconds=pg_timeout_s))
        result = fn(rank, world_size, **kwargs)
    except BaseException as e:  # reported to the parent, which fails the test
        result = RankFailure(rank, repr(e),
                             f"{traceback.format_exc()}\naccord-test: steps done {DONE[0]}")
    with open(out + ".tmp", "wb") as f:
        pickle.dump(result, f)
    os.replace(out + ".tmp", out)
    os._exit(0)


def run_ds_ranks(fn, world_size, timeout_s=90.0, pg_timeout_s=20.0, **kwargs):
    import multiprocessing as mp
    import time

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="accord-ds-") as tmpdir:
        procs = [ctx.Process(target=_entry, args=(fn, r, world_size, tmpdir, pg_timeout_s, kwargs),
                             daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        stuck = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results = []
        keep = os.environ.get("ACCORD_TEST_KEEP_STDERR")  # a folder: each rank's stderr
        for r in range(world_size):
            if keep:
                import shutil

                shutil.copy(os.path.join(tmpdir, f"stderr.{r}"), os.path.join(keep, f"stderr.{r}"))
            path = os.path.join(tmpdir, f"result.{r}")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    results.append(pickle.load(f))
            else:
                with open(os.path.join(tmpdir, f"stderr.{r}"), errors="replace") as f:
                    text = f.read()
                # The last progress line and the C++ error that ended it, then
                # the end (the fault dump after them can be long).
                lines = text.splitlines()
                done = [line for line in lines if line.startswith("accord-test:")][-1:]
                what = [line for line in lines if "what():" in line][-1:]
                results.append(RankDied(r, procs[r].exitcode,
                                        "\n".join(done + what + [text[-4000:]])))
        if stuck:
            raise RanksTimedOut(f"ranks {stuck} of {world_size} still running after "
                                f"{timeout_s}s; results so far: {results}")
        return results


# ---------------------------------------------------------------- the model


SEQ, LAYERS = 24, 5  # the sequential models: LAYERS Linear(SEQ, SEQ), 600 parameters each
CHANGE_ROWS, CHANGE_STEP = 4, 2  # seq-swap, seq-freeze: the change, from this step on every rank


def make_model(kind="toy"):
    """`toy` (above); `toy-torch-ckpt`: the same with the body and the tower
    under torch.utils.checkpoint (non-reentrant), so their forward runs again
    in the backward; `toy-deepspeed-ckpt`: the body under
    deepspeed.checkpointing.checkpoint (reentrant: the tower's input needs no
    gradient, so under it the tower would get none); `seq`: LAYERS linear layers,
    autograd's order the reverse of their definition; `late`: the same with
    the input layer defined last, so it comes first in release order and its
    gradient last; `toy-placed`: the toy whose tower output joins after the
    body where the image has 3 rows (odd ranks' batches), before it
    otherwise, so the tower's gradient comes before the body's backward
    all-gather on one rank and after it on the other.

    Sequential models whose ZeRO-3 all-gathers change inside a backward
    (the same on every rank): `seq-twice`: layer 0 runs first and again
    after layer 2, so its backward fetches it twice; `seq-frozen`: layer 0
    frozen (its backward never runs, nothing is fetched for it);
    `seq-swap`: layers 1 and 2 run in swapped order on batches of 4 rows
    (steps 2 on, every rank), so DeepSpeed invalidates its module trace;
    `seq-freeze`: layer 0 frozen on those batches (trained before)."""
    import torch
    from torch import nn

    if not kind.startswith("toy"):
        torch.manual_seed(0)
        layers = [nn.Linear(SEQ, SEQ) for _ in range(LAYERS)]
        if kind == "late":  # the first layer run, registered last
            layers = layers[1:] + layers[:1]
        if kind == "seq-frozen":
            layers[0].requires_grad_(False)

        class Seq(nn.Module):
            def __init__(self):
                super().__init__()
                self.layers = nn.ModuleList(layers)

            def forward(self, x, image=None):
                order = list(self.layers)
                if kind == "late":
                    order = order[-1:] + order[:-1]
                if kind == "seq-twice":
                    order = order[:3] + order[:1] + order[3:]
                if kind == "seq-freeze":  # its backward stops running
                    order[0].requires_grad_(x.shape[0] != CHANGE_ROWS)
                if kind == "seq-swap" and x.shape[0] == CHANGE_ROWS:
                    order = [order[0], order[2], order[1]] + order[3:]
                for layer in order:
                    x = torch.tanh(layer(x))
                return x.pow(2).mean()

        return Seq()

    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(IN, HID)
            self.tower = nn.Linear(IMG, HID)
            self.body = nn.Linear(HID, HID)
            self.head = nn.Linear(HID, 1)

        def forward(self, x, image=None):
            h = self.embed(x)
            after_body = kind == "toy-placed" and image is not None and image.shape[0] == 3
            if image is not None and not after_body:
                tower = _run if kind == "toy-torch-ckpt" else (lambda m, x: m(x))
                h = h + tower(self.tower, image).mean(0, keepdim=True)
            h = _run(self.body, h)
            if after_body:
                h = h + self.tower(image).mean(0, keepdim=True)
            return self.head(torch.tanh(h)).pow(2).mean()

    def _run(module, x):
        if kind == "toy-torch-ckpt":
            from torch.utils.checkpoint import checkpoint

            return checkpoint(module, x, use_reentrant=False)
        if kind == "toy-deepspeed-ckpt":
            import deepspeed

            return deepspeed.checkpointing.checkpoint(module, x)
        return module(x)

    torch.manual_seed(0)
    return Toy()


def usage(case, rank, step, micro=0):
    """Whether this rank's microbatch carries an image."""
    if case == "all":
        return True
    if case == "never_on_1":
        return rank != 1
    if case == "skip_at_3":
        return not (rank == 1 and step == 3)
    if case == "nowhere_at_1":  # no rank uses the tower at step 1
        return step != 1
    if case == "one_micro":  # only rank 0's last microbatch
        return rank == 0 and micro == 1
    if case == "first_micro":  # only rank 0's first microbatch
        return rank == 0 and micro == 0
    if case == "on_0_at_even":  # rank 0 at steps 0, 2, ...; no rank at odd steps
        return rank == 0 and step % 2 == 0
    raise ValueError(case)


def batch(rank, step, micro, case, kind="toy"):
    import torch

    g = torch.Generator().manual_seed(1000 * step + 100 * micro + rank)
    n = CHANGE_ROWS if kind in ("seq-swap", "seq-freeze") and step >= CHANGE_STEP else 3
    x = torch.randn(n, IN if kind.startswith("toy") else SEQ, generator=g)
    rows = 3 if kind == "toy-placed" and rank % 2 else 2
    image = torch.randn(rows, IMG, generator=g) if usage(case, rank, step, micro) else None
    return x, image


def ds_config(stage, world_size, gas=1, dtype="fp32", persistence=None, zero3=None):
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": gas,
        "train_batch_size": world_size * gas,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":  # dynamic loss scaling: a step with inf/nan gradients is skipped
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 100,
                       "hysteresis": 1, "min_loss_scale": 1}
    if persistence is not None:  # ZeRO-3: parameters at most this large stay gathered
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = persistence
    cfg["zero_optimization"].update(zero3 or {})  # more ZeRO-3 settings
    return cfg


def _grad_of(model_state, rank_batches, world_size, gas, dtype="fp32", kind="toy"):
    """The reference: each microbatch's gradient (in the training dtype, from
    the same starting parameters), summed in float32, divided by W x GAS."""
    import torch

    model = make_model(kind)
    model.load_state_dict(model_state, strict=False)  # frozen parameters: as built
    tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)
    model.to(tdtype)
    total = {n: None for n, _ in model.named_parameters()}
    for x, image in rank_batches:
        model.zero_grad(set_to_none=True)
        loss = model(x.to(tdtype), None if image is None else image.to(tdtype))
        (loss / (world_size * gas)).backward()
        for n, p in model.named_parameters():
            if p.grad is not None:
                g = p.grad.float()
                total[n] = g if total[n] is None else total[n] + g
    return total


def _trace_collectives(record=None):
    """Prints each torch.distributed collective with its element count
    (debugging), or appends (name, element counts) to `record`."""
    import torch.distributed as dist

    for name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "broadcast",
                 "all_gather", "reduce_scatter", "_all_gather_base", "_reduce_scatter_base",
                 "all_to_all_single", "all_gather_coalesced", "barrier"):
        fn = getattr(dist, name, None)
        if fn is None:
            continue

        def wrap(fn=fn, name=name):
            def traced(*args, **kwargs):
                sizes = [a.numel() for a in args if hasattr(a, "numel")]
                if record is not None:
                    record.append((name, tuple(sizes)))
                else:
                    print(f"accord-trace: {name} {sizes}", file=sys.stderr, flush=True)
                return fn(*args, **kwargs)
            return traced

        setattr(dist, name, wrap())
    # DeepSpeed's torch backend keeps its own references to these two.
    from deepspeed.comm import comm as ds_comm

    for attr, name in (("all_gather_function", "all_gather_into_tensor"),
                       ("reduce_scatter_function", "reduce_scatter_tensor")):
        fn = getattr(ds_comm.cdb, attr, None)
        if fn is not None:
            def traced(*args, __fn=fn, __name=name, **kwargs):
                sizes = [a.numel() for a in list(args) + list(kwargs.values())
                         if hasattr(a, "numel")]
                if record is not None:
                    record.append((__name, tuple(sizes)))
                return __fn(*args, **kwargs)

            setattr(ds_comm.cdb, attr, traced)


def _allow_cpu_fp16():
    """DeepSpeed's CPU accelerator says fp16 is supported only where oneDNN
    has fp16 kernels (`torch.ops.mkldnn._is_mkldnn_fp16_supported()`, False
    on this CPU), and the engine then refuses fp16 ("Type fp16 is not
    supported on your device", engine.py `_do_sanity_check`). torch's CPU
    half kernels run every op of these models, so the test overrides the
    check, in this rank's process only, to test fp16 with the loss scaler."""
    from deepspeed.accelerator import get_accelerator

    get_accelerator().is_fp16_supported = lambda: True


def _mark_leaf(model, leaf):
    """ZeRO-3 leaf modules (DeepSpeed fetches each whole at its forward and
    reduces its parameters from one module backward hook, zero-filling those
    without a gradient): module paths, or classes (set_z3_leaf_modules)."""
    from deepspeed.utils import set_z3_leaf_module, set_z3_leaf_modules

    classes = [m for m in leaf if isinstance(m, type)]
    if classes:
        set_z3_leaf_modules(model, classes)
    for path in (m for m in leaf if isinstance(m, str)):
        set_z3_leaf_module(model.get_submodule(path), True)


def _copy(t):
    """A copy of what DeepSpeed's safe_get_full_* gave (None for a frozen parameter)."""
    return None if t is None else t.clone()


def train(rank, world_size, stage=2, case="all", steps=4, gas=1, dtype="fp32", accord="none",
          cluster=None, wd=0.1, coalesce=0, persistence=None, optional=(), die=None,
          zero3=None, learn=None, kind="toy", turns=None, record=False, leaf=(),
          overflow=None):
    """Trains `steps` steps; returns per step the full reduced gradients (read
    before engine.step()), the reference gradients, and the parameters and
    Adam moments of the tower before and after the step. `leaf`: paths of
    modules marked ZeRO-3 leaf modules before deepspeed.initialize;
    `overflow`: (rank, step) whose loss is made inf (fp16: the loss scaler
    skips that step)."""
    import torch
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad, \
        safe_get_full_optimizer_state

    collectives = [] if record else None  # every collective this rank issued, in order
    if os.environ.get("ACCORD_TEST_TRACE") or record:
        _trace_collectives(collectives)
    if dtype == "fp16":
        _allow_cpu_fp16()
    model = make_model(kind)
    _mark_leaf(model, leaf)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=wd)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt,
                                           config=ds_config(stage, world_size, gas, dtype,
                                                            persistence, zero3))
    inst = None
    if accord != "none":
        from accord import connect
        from accord import deepspeed as accord_ds

        client = None
        if accord == "cluster":  # the real daemons of a LocalCluster
            client = connect(socket_path=cluster["sockets"][rank],
                                        job_id=cluster["job_id"], rank=rank,
                                        world_size=world_size,
                                        local_rank=cluster["local_ranks"][rank])
        inst = accord_ds.install(engine, client, timeout_s=30.0, optional=optional, turns=turns,
                                 **({} if learn is None else {"learn_optional": learn}))
    names = [n for n, p in engine.module.named_parameters() if p.requires_grad]
    if os.environ.get("ACCORD_TEST_TRACE") and stage == 3:
        for n, p in engine.module.named_parameters():
            print(f"accord-trace: {n} persist={p.ds_persist} status={p.ds_status}",
                  file=sys.stderr, flush=True)
    params = dict(engine.module.named_parameters())
    out = []
    known = {}  # the last fp32 value read (a parameter frozen since keeps it)
    for step in range(steps):
        start = {n: _copy(safe_get_full_fp32_param(params[n])) for n in names}
        start = {n: known.get(n) if v is None else v for n, v in start.items()}
        known.update(start)
        # Every rank's batches, for the reference.
        # `coalesce` backwards in one engine.coalesce_grad_reduction() block,
        # else `gas` microbatches with a micro-step between them.
        micros = coalesce or gas
        all_batches = [batch(r, step, m, case, kind) for r in range(world_size)
                       for m in range(micros)]
        ref = _grad_of({n: start[n] for n in names}, all_batches, world_size, gas, dtype, kind)
        dt = next(engine.module.parameters()).dtype

        def micro(m):
            x, image = batch(rank, step, m, case, kind)
            if die == (rank, step, "forward"):
                os._exit(1)
            loss = engine(x.to(dt), None if image is None else image.to(dt))
            if overflow == (rank, step):
                loss = loss * float("inf")
            if die == (rank, step, "backward"):
                os._exit(1)
            engine.backward(loss)

        if coalesce:
            with engine.coalesce_grad_reduction():
                for m in range(micros):
                    micro(m)
        else:
            for m in range(micros):
                micro(m)
                if m < micros - 1:
                    engine.step()  # a micro-step: no optimizer step
        grads = {}
        for n in names:
            g = safe_get_full_grad(params[n])
            grads[n] = None if g is None else g.detach().float().clone()
        moments = {key: None if step == 0 else  # no optimizer state before the first step
                   {n: _copy(safe_get_full_optimizer_state(params[n], key)) for n in names}
                   for key in ("exp_avg", "exp_avg_sq")}
        scale = getattr(engine.optimizer, "loss_scale", 1.0)  # what the gradients carry
        engine.step()
        after = {n: _copy(safe_get_full_fp32_param(params[n])) for n in names}
        after_moments = {key: {n: _copy(safe_get_full_optimizer_state(params[n], key))
                               for n in names} for key in ("exp_avg", "exp_avg_sq")}
        lp_after = {n: params[n].detach().clone() for n in names}
        DONE[0] = step + 1
        print(f"accord-test: steps done {DONE[0]}", file=sys.stderr, flush=True)
        guard = None if inst is None else inst.guard
        out.append({"grads": grads, "ref": ref, "start": start, "after": after,
                    "moments": moments, "after_moments": after_moments, "lp_after": lp_after,
                    "scale": float(scale), "skipped": int(engine.skipped_steps),
                    "guard_waits": None if guard is None else guard.blocking_waits,
                    "guard_reports": None if guard is None else guard.reports})
    if inst is not None:
        import dataclasses
        stats = dataclasses.asdict(inst.stats)
        gathers = inst.all_gathers
        recorded = None if gathers is None else (gathers.recorded, gathers.trace_checks)
        learner = None if inst.guard is None else inst.guard.learner
        learned = None if learner is None else list(learner.learned)
        inst.uninstall()
        from accord.deepspeed import zero

        left = [n for n in zero._PATCHED + ("step", "backward_prologue")
                if n in engine.optimizer.__dict__]
        offload = getattr(engine.optimizer, "parameter_offload", None)
        if offload is not None:
            left += [n for n in zero._SUB_MODULE_FUNCTIONS if n in offload.__dict__]
            left += [n for n in (zero._ALL_GATHER, "reset_step")
                     if n in offload.get_param_coordinator().__dict__]
        out.append({"stats": stats, "left_patched": left, "all_gathers_recorded": recorded,
                    "learned": learned, "collectives": collectives})
    return out


# ---------------------------------------------------------------- real model code


LLAVA_OPTIONAL = ("model.vision_tower", "model.multi_modal_projector")


def _family(name):
    """(build, batch(rank, step, k), loss(model, batch), ZeRO-3 optional paths)."""
    import model_scenarios as ms

    if name == "llava":
        return ms.build_llava, ms.llava_batch, lambda m, b: m(**b).loss, LLAVA_OPTIONAL
    if name == "custom_moe":  # one module per expert; some get no tokens on a rank
        experts = tuple(f"layers.{i}.moe.experts.{e}" for i in range(2)
                        for e in range(ms.CustomMoELM.N_EXPERTS))
        return ms.build_custom_moe, ms.custom_moe_batch, lambda m, b: m(**b), experts
    raise ValueError(name)


def family(rank, world_size, name="llava", stage=3, steps=2, gas=2, accord="embedded",
           cluster=None, persistence=0, leaf=False, coalesce=False, turns=None):
    """Real model code from model_scenarios (tiny configs, random weights) under
    ZeRO. llava: transformers' LlavaForConditionalGeneration (CLIP tower,
    Llama decoder), even ranks see an image in one microbatch per step, odd
    ranks are text-only. custom_moe: an MoE language model with one module
    per expert, experts without tokens on some ranks and one on no rank;
    `leaf`: each MoE layer (router and experts) a ZeRO-3 leaf module, so
    optional= is not given. `coalesce`: the `gas` backwards of a step in one
    engine.coalesce_grad_reduction() block. `turns`: install's.
    Returns per step the reduced gradients, a single-process reference, and
    the parameters before and after the step."""
    import torch
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    build, make_batch, loss_of, optional = _family(name)
    model = build()
    if leaf:
        import model_scenarios as ms

        _mark_leaf(model, [ms.HashMoE])
        optional = ()
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=opt,
        config=ds_config(stage, world_size, 1 if coalesce else gas, "fp32", persistence))
    inst = None
    if accord != "none":
        from accord import connect
        from accord import deepspeed as accord_ds

        client = None
        if accord == "cluster":
            client = connect(socket_path=cluster["sockets"][rank], job_id=cluster["job_id"],
                             rank=rank, world_size=world_size,
                             local_rank=cluster["local_ranks"][rank])
        inst = accord_ds.install(engine, client, timeout_s=30.0, turns=turns,
                                 optional=optional if stage == 3 else ())
    params = dict(engine.module.named_parameters())
    names = list(params)
    out = []
    for step in range(steps):
        start = {n: _copy(safe_get_full_fp32_param(params[n])) for n in names}
        ref_model = build()
        missing, unexpected = ref_model.load_state_dict(start if step else init, strict=False)
        assert not unexpected and not set(missing) & set(start), (missing, unexpected)
        for r in range(world_size):
            for k in range(gas):
                scale = world_size * (1 if coalesce else gas)
                (loss_of(ref_model, make_batch(r, step, k)) / scale).backward()
        ref = {n: (p.grad.clone() if p.grad is not None else None)
               for n, p in ref_model.named_parameters()}
        with engine.coalesce_grad_reduction() if coalesce else contextlib.nullcontext():
            for k in range(gas):
                engine.backward(loss_of(engine, make_batch(rank, step, k)))
                if k < gas - 1 and not coalesce:
                    engine.step()
        grads = {n: safe_get_full_grad(params[n]).detach().float().clone() for n in names}
        scale = getattr(engine.optimizer, "loss_scale", 1.0)  # what the gradients carry
        engine.step()
        after = {n: _copy(safe_get_full_fp32_param(params[n])) for n in names}
        DONE[0] = step + 1
        print(f"accord-test: steps done {DONE[0]}", file=sys.stderr, flush=True)
        out.append({"grads": grads, "ref": ref, "start": start, "after": after})
    if inst is not None:
        inst.uninstall()
    return out


# ---------------------------------------------------------------- the HF Trainer


def hf_trainer(rank, world_size, out_dir, stage=2, accord="none", steps=2, accumulation=2):
    """transformers' Trainer(deepspeed=<config>) on the tiny LLaVA of
    hf_scenarios (even ranks image+text, odd ranks text only), with
    accord.deepspeed.hf.AccordDeepSpeedCallback when `accord` is "embedded".
    Returns the losses and, at the first optimizer step, every parameter's
    full gradient and the batches this rank trained on."""
    import torch
    from deepspeed.utils import safe_get_full_grad
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import hf_scenarios as hs
    import model_scenarios as ms

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29555"))
    model = ms.build_llava()
    seen = []

    def collate(items):
        batch = {k: torch.stack([it[k] for it in items]) for k in items[0]}
        seen.append({k: v.clone() for k, v in batch.items()})
        return batch

    class Recorder(TrainerCallback):
        """Every parameter's full gradient at the first ZeRO optimizer step
        (Accelerate steps the engine inside its backward, before the Trainer's
        on_pre_optimizer_step, so the step itself is wrapped)."""

        grads = None

        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            zero_optimizer = optimizer.optimizer
            own = zero_optimizer.step

            def step(*a, **k):
                if self.grads is None:
                    self.grads = {n: safe_get_full_grad(p).detach().float().clone()
                                  for n, p in model.named_parameters()}
                return own(*a, **k)

            zero_optimizer.step = step

    recorder = Recorder()
    callbacks = [recorder]
    accord_cb = None
    if accord != "none":
        from accord.deepspeed.hf import AccordDeepSpeedCallback

        accord_cb = AccordDeepSpeedCallback(
            optional=LLAVA_OPTIONAL if stage == 3 else (), timeout_s=30.0)
        callbacks.insert(0, accord_cb)
    cfg = ds_config(stage, world_size, accumulation, "fp32", 0 if stage == 3 else None)
    args = TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=1, gradient_accumulation_steps=accumulation,
        max_steps=steps, use_cpu=True, report_to=[], save_strategy="no", logging_steps=1,
        max_grad_norm=0.0, learning_rate=1e-3, dataloader_num_workers=0, seed=0,
        disable_tqdm=True, deepspeed=cfg)
    trainer = Trainer(model=model, args=args, train_dataset=hs.RankDataset(rank),
                      data_collator=collate, callbacks=callbacks)
    out = trainer.train()
    return {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "training_loss": out.training_loss, "grads": recorder.grads,
            "batches": seen[:accumulation],
            "stats": None if accord_cb is None else
            __import__("dataclasses").asdict(accord_cb.installation.stats)}


# ---------------------------------------------------------------- Accelerate


def accelerate_train(rank, world_size, stage=3, case="on_0_at_even", steps=4, accord="embedded"):
    """The toy model through accelerate's Accelerator with a DeepSpeedPlugin
    (no Trainer): accelerator.prepare builds the engine, accord installs on
    it (ZeRO-3: optional=["tower"]), accelerator.backward runs the engine's
    backward and step. Returns per step the gradients at the ZeRO optimizer's
    step, the reference, and the parameters before and after."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29556"),
                      ACCELERATE_USE_DEEPSPEED="true")  # as the Trainer sets it; else DDP on CPU
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    plugin = DeepSpeedPlugin(hf_ds_config=ds_config(stage, world_size, 1, "fp32",
                                                    0 if stage == 3 else None))
    accelerator = Accelerator(deepspeed_plugin=plugin)  # not cpu=True: that means no DeepSpeed
    engine, opt = accelerator.prepare(model, opt)
    inst = None
    if accord != "none":
        from accord import deepspeed as accord_ds

        inst = accord_ds.install(engine, timeout_s=30.0,
                                 optional=("tower",) if stage == 3 else ())
    params = dict(engine.module.named_parameters())
    seen = {}
    zero_optimizer = engine.optimizer
    own = zero_optimizer.step

    def step(*a, **k):  # the gradients DeepSpeed hands the optimizer
        seen["grads"] = {n: safe_get_full_grad(p).detach().float().clone()
                         for n, p in params.items()}
        return own(*a, **k)

    zero_optimizer.step = step
    out = []
    for s in range(steps):
        start = {n: safe_get_full_fp32_param(p).clone() for n, p in params.items()}
        batches = [batch(r, s, 0, case) for r in range(world_size)]
        ref = _grad_of(start, batches, world_size, 1)
        x, image = batch(rank, s, 0, case)
        accelerator.backward(engine(x, image))
        opt.step()
        opt.zero_grad()
        after = {n: safe_get_full_fp32_param(p).clone() for n, p in params.items()}
        DONE[0] = s + 1
        print(f"accord-test: steps done {DONE[0]}", file=sys.stderr, flush=True)
        out.append({"grads": seen.pop("grads"), "ref": ref, "start": start, "after": after})
    if inst is not None:
        inst.uninstall()
    return out
