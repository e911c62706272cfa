"""Kernel benchmarks: the fused policy loss from hidden states vs materialized logits.

Every figure is forward + backward of the clipped policy loss (clip-higher, entropy bonus)
on [N, H] hidden states and a [V, H] LM head, measured side by side in one run:

* naive PyTorch: logits = hidden @ W.T, fp32 log_softmax, gather, entropy, the same
  per-token loss (`policy_loss_terms`), autograd backward. This is what holds the [N, V]
  logits several times over.
* fastpo chunked (the CPU path) and fastpo Triton (the CUDA path): `linear_policy_loss`.
* Liger-Kernel's `LigerFusedLinearGRPOLoss` (chunked PyTorch, torch.compile'd), only when
  `liger_kernel` imports (GPU runs).
* On the CPU, the three bare matmuls the chunked path cannot avoid (logits, d hidden, d W;
  6 N H V FLOPs) and one square 2048^3 matmul (the machine's matmul FLOP/s, best run), in the
  same alternation: fastpo's and naive's time as a multiple of the three (target for fastpo:
  within 1.15x) and their FLOP/s as a fraction of the machine's (`limit_record`).
* On CUDA, four plain `torch.matmul`s of the same shapes (forward, recompute and the two
  backward products, 8 N H V FLOPs): the fused loss's time against them (the ratio of
  their TFLOP/s), and the fused loss's achieved TFLOP/s as a fraction of the device's
  dense bf16 peak (`dense_bf16_peak`: 989 TFLOP/s on H100 SXM and H200, from the device
  name; no fraction for a device not in the table).

Shapes: CPU H=576, V=49152, N=2048 fp32 (--quick: N=128); CUDA H=896, V=151936 (Qwen2.5),
N in {4096, 16384} bf16 (--quick: 4096). Peak memory is what a call adds above what was
allocated before it, minus the gradients it returns (d hidden, d weight), which every
method produces alike ("beyond inputs, outputs and gradients").

A method that raises (e.g. a Liger release with another signature) does not vanish: it
becomes a record named "... <method> failed (<error>)" with met=False and the target its
comparison would have carried, so the JSON and the table show the missing figure. On CUDA
a Liger that does not import gets a record saying so (no target: the issue asks for the
comparison only where liger_kernel is importable).
"""
from __future__ import annotations

import gc
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import BenchContext, Record, measure, peak_memory  # noqa: E402

PART = "kernels"
OPTS = dict(clip_low=0.2, clip_high=0.28, entropy_coef=0.001)
LIGER = "liger-fused-linear-grpo"
# Dense (no 2:4 sparsity) bf16 tensor-core peaks, TFLOP/s, from NVIDIA's data sheets, by a
# substring of torch.cuda.get_device_name(); the first match wins (PCIe/NVL before plain H100).
DENSE_BF16_PEAKS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0),
                    ("H800", 989.0), ("A100", 312.0))


def dense_bf16_peak(device_name: str) -> float | None:
    """The dense bf16 peak (TFLOP/s) of a GPU named `device_name`, or None if not in the table."""
    for key, peak in DENSE_BF16_PEAKS:
        if key.lower() in device_name.lower():
            return peak
    return None


def _inputs(n, h, v, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(device=device, dtype=dtype)
    weight = (torch.randn(v, h, generator=g) * h ** -0.5).to(device=device, dtype=dtype)
    targets = torch.randint(0, v, (n,), generator=g).to(device)
    old = (-3.0 - torch.rand(n, generator=g)).to(device)
    adv = torch.randn(n, generator=g).to(device)
    mask = (torch.rand(n, generator=g) > 0.1).to(device)
    return hidden, weight, targets, old, adv, mask


def _naive(hidden, weight, targets, old, adv, mask):
    from fastpo.kernels import policy_loss_terms

    logits = (hidden @ weight.T).float()
    logp = torch.log_softmax(logits, dim=-1)
    lp = logp.gather(-1, targets[:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    terms = policy_loss_terms(lp, ent, old, adv, **OPTS)
    m = mask.float()
    return (terms["loss"] * m).sum() / m.sum()


def _step(fn, hidden, weight):
    """One forward + backward from fresh leaves; returns the leaves (their .grad set)."""
    h = hidden.detach().requires_grad_(True)
    w = weight.detach().requires_grad_(True)
    fn(h, w).backward()
    return h, w


def _extra_peak(fn, hidden, weight, device) -> int:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    peak, (h, w) = peak_memory(lambda: _step(fn, hidden, weight), device=device)
    grads = h.grad.numel() * h.grad.element_size() + w.grad.numel() * w.grad.element_size()
    del h, w
    return max(1, peak - grads)


def _methods(data, device, chunk_size=None):
    from fastpo.kernels import linear_policy_loss

    hidden, weight, targets, old, adv, mask = data
    impl = "triton" if device == "cuda" else "chunked"
    methods = {
        "naive": lambda h, w: _naive(h, w, targets, old, adv, mask),
        f"fastpo-{impl}": lambda h, w: linear_policy_loss(h, w, targets, old, adv, mask, impl=impl,
                                                          chunk_size=chunk_size, **OPTS).loss,
    }
    if device == "cuda" and hidden.shape[0] <= 4096:  # the CPU path on the GPU, for reference
        methods["fastpo-chunked"] = lambda h, w: linear_policy_loss(h, w, targets, old, adv, mask, impl="chunked",
                                                                    **OPTS).loss
    liger, why_not = _liger_fn(data)
    if liger is not None:
        methods[LIGER] = liger
    return impl, methods, why_not


def _liger_fn(data):
    """(Liger's loss as fn(h, w), None), or (None, why it is not available)."""
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except Exception as e:  # not installed (CPU machines): the comparison is skipped
        return None, f"liger_kernel not importable ({type(e).__name__}: {e})"
    hidden, weight, targets, old, adv, mask = data
    n = hidden.shape[0]
    seq = 512 if n % 512 == 0 else n
    b = n // seq
    loss_mod = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, epsilon_low=OPTS["clip_low"],
                                        epsilon_high=OPTS["clip_high"], loss_type="bnpo")
    adv_seq = adv.view(b, seq)[:, 0].contiguous()  # Liger takes one advantage per sequence

    def fn(h, w):
        out = loss_mod(h.view(b, seq, -1), w, targets.view(b, seq), mask.view(b, seq).long(), adv_seq,
                       old_per_token_logps=old.view(b, seq))
        return out[0] if isinstance(out, tuple) else out

    return fn, None


def _time(fn, hidden, weight, ctx, sync, warmup=1):
    return measure(lambda: _step(fn, hidden, weight), repeats=ctx.repeats, warmup=warmup, sync=sync)


def _time_interleaved(fns: dict, hidden, weight, ctx, sync, plain: dict | None = None) -> dict:
    """Median, spread and best (s) per method, runs alternating A B A B ... so that a change of
    machine load (other jobs on a shared CPU) hits every method alike. `plain`: more
    callables (no arguments, e.g. bare matmuls) timed in the same alternation."""
    plain = plain or {}
    runs = {k: [] for k in list(fns) + list(plain)}
    for k, fn in plain.items():
        fn()  # warm-up (the methods' warm-up is the memory run before)
    for _ in range(ctx.repeats):
        for k, fn in fns.items():
            runs[k].append(measure(lambda: _step(fn, hidden, weight), repeats=1, warmup=0, sync=sync)[0])
        for k, fn in plain.items():
            runs[k].append(measure(fn, repeats=1, warmup=0, sync=sync)[0])
    return {k: (statistics.median(v), max(v) - min(v), min(v)) for k, v in runs.items()}


def _cpu(ctx: BenchContext) -> list[Record]:
    # --quick (that the part runs and what it records, not figures): a sixteenth of the tokens,
    # in two 64-token chunks, so that the chunked path still loops
    n, h, v = (128 if ctx.quick else 2048), 576, 49152
    chunk = 64 if ctx.quick else None
    data = _inputs(n, h, v, torch.float32, "cpu", ctx.seed)
    impl, methods, _ = _methods(data, "cpu", chunk)
    shape = f"N={n} H={h} V={v} fp32" + (f", chunk_size={chunk}" if chunk else "")
    # the memory run comes first and doubles as the warm-up of the timed runs
    m_naive = _extra_peak(methods["naive"], data[0], data[1], "cpu")
    m_fast = _extra_peak(methods[f"fastpo-{impl}"], data[0], data[1], "cpu")
    mm_run, mm_flops = bare_matmuls(n, h, v, torch.float32, "cpu", ctx.seed)
    sq_run, sq_flops = square_matmul("cpu", torch.float32)
    timed = _time_interleaved({"naive": methods["naive"], "fastpo": methods[f"fastpo-{impl}"]}, data[0], data[1],
                              ctx, None, plain={"matmuls": mm_run, "square": sq_run})
    (t_naive, s_naive, _), (t_fast, s_fast, _) = timed["naive"], timed["fastpo"]
    t_mm, s_mm, _ = timed["matmuls"]
    machine = sq_flops / timed["square"][2]
    limits = [limit_record(PART, shape, name, t, t_mm, 3, mm_flops, machine,
                           target=1 / 1.15 if name.startswith("fastpo") else None, spreads=(sp, s_mm),
                           notes=f"median of {ctx.repeats} runs, alternating with the other methods; machine: best "
                                 "2048^3 fp32 matmul in the same alternation")
              for name, t, sp in ((f"fastpo-{impl}", t_fast, s_fast), ("naive", t_naive, s_naive))]
    return limits + [
        Record(PART, f"policy loss fwd+bwd time, {impl} ({shape})", "s", t_fast, t_naive, False, s_fast, s_naive,
               "naive PyTorch (materialized logits)", target=1 / 1.2,
               notes=f"median of {ctx.repeats} runs, alternating with the baseline's"),
        Record(PART, f"policy loss peak memory, {impl} ({shape})", "MiB", m_fast / 2**20, m_naive / 2**20, False,
               baseline_name="naive PyTorch (materialized logits)", target=4.0,
               notes="resident-set high-water mark (VmHWM, reset before the call) above the start, minus the "
               "returned gradients"),
    ]


def bare_matmuls(n: int, h: int, v: int, dtype, device: str, seed: int = 0):
    """(run, flops): the matmuls a fused linear loss cannot avoid, as plain torch.mm calls on
    random operands of the loss's shapes. CPU (the chunked path: logits, d hidden, d W):
    three, 6 N H V FLOPs; CUDA (the Triton path also recomputes the logits in the backward):
    four, 8 N H V FLOPs. `run()` does them once (into preallocated outputs on the CPU)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, h, generator=g).to(device=device, dtype=dtype)
    w = torch.randn(v, h, generator=g).to(device=device, dtype=dtype)
    d = torch.randn(n, v, generator=g).to(device=device, dtype=dtype)
    cuda = str(device).startswith("cuda")
    z, dh, dw = torch.empty_like(d), torch.empty_like(a), torch.empty_like(w)

    def run():
        torch.mm(a, w.T, out=z)
        if cuda:
            torch.mm(a, w.T, out=z)  # the backward's recompute
        torch.mm(d, w, out=dh)
        torch.mm(d.T, a, out=dw)

    return run, (8.0 if cuda else 6.0) * n * h * v


def square_matmul(device: str, dtype, size: int | None = None):
    """(run, flops) of one square size^3 matmul (default 2048 on the CPU, 8192 on CUDA): the
    machine's matmul FLOP/s is flops over its best time, timed in the same alternation as the
    methods so that the machine's load hits both alike."""
    size = size or (8192 if str(device).startswith("cuda") else 2048)
    a = torch.randn(size, size).to(device=device, dtype=dtype)
    b = torch.randn(size, size).to(device=device, dtype=dtype)
    out = torch.empty_like(a)
    return (lambda: torch.mm(a, b, out=out)), 2.0 * size ** 3


def limit_record(part: str, shape: str, method: str, t_method: float, t_mm: float, n_mm: int, flops: float,
                 machine_flops: float, target: float | None = None, spreads=(0.0, 0.0), notes: str = "") -> Record:
    """`method`'s fwd+bwd time against the `n_mm` bare matmuls it cannot avoid (ratio = their
    time over its own, so 1/1.15 means 'within 1.15x'), with its FLOP/s (the matmuls' `flops`
    over its time) as a fraction of the machine's measured matmul FLOP/s in the notes."""
    frac = flops / t_method / machine_flops
    mm_frac = flops / t_mm / machine_flops
    note = (f"{method}: {t_method / t_mm:.2f}x the {n_mm} bare matmuls ({flops / 1e9:.0f} GFLOP); "
            f"{flops / t_method / 1e9:.1f} GFLOP/s = {frac:.0%} of the machine's measured matmul "
            f"{machine_flops / 1e9:.1f} GFLOP/s (bare matmuls: {mm_frac:.0%})")
    return Record(part, f"{method} fwd+bwd vs the {n_mm} bare matmuls ({shape})", "s", t_method, t_mm, False,
                  spreads[0], spreads[1], f"torch.mm x{n_mm}", target=target,
                  notes=note + (f"; {notes}" if notes else ""))


def _four_matmuls(n, h, v, dtype, ctx):
    g = torch.Generator(device="cuda").manual_seed(ctx.seed)
    a = torch.randn(n, h, device="cuda", dtype=dtype, generator=g)
    w = torch.randn(v, h, device="cuda", dtype=dtype, generator=g)
    d = torch.randn(n, v, device="cuda", dtype=dtype, generator=g)

    def run():
        torch.matmul(a, w.T)
        torch.matmul(a, w.T)  # the backward's recompute
        torch.matmul(d, w)
        torch.matmul(d.T, a)

    t, s = measure(run, repeats=ctx.repeats, warmup=1, sync=torch.cuda.synchronize)
    del a, w, d
    torch.cuda.empty_cache()
    return t, s


def _cuda(ctx: BenchContext) -> list[Record]:
    h, v, dtype = 896, 151936, torch.bfloat16
    sync = torch.cuda.synchronize
    records = []
    for n in ([4096] if ctx.quick else [4096, 16384]):
        shape = f"N={n} H={h} V={v} bf16"
        data = _inputs(n, h, v, dtype, "cuda", ctx.seed)
        impl, methods, liger_missing = _methods(data, "cuda")
        times, mems, failed = {}, {}, {}
        for name, fn in methods.items():
            try:
                times[name] = _time(fn, data[0], data[1], ctx, sync)
                mems[name] = _extra_peak(fn, data[0], data[1], "cuda")
            except Exception as e:  # e.g. a Liger version with another signature: record it, keep going
                failed[name] = f"{type(e).__name__}: {e}"
                print(f"part kernels: {name} at {shape} failed: {failed[name]}", file=sys.stderr)
            torch.cuda.empty_cache()
        fast = f"fastpo-{impl}"
        records += _failure_records(shape, fast, times, failed, liger_missing)
        t_mm, s_mm = _four_matmuls(n, h, v, dtype, ctx)
        if fast in times:
            tf, sf = times[fast]
            records += throughput_records(shape, n, h, v, tf, t_mm, torch.cuda.get_device_name())
            for base in ("naive", "fastpo-chunked", LIGER):
                if base not in times:
                    continue
                tb, sb = times[base]
                target = {"naive": None, "fastpo-chunked": None, LIGER: 2.0}[base]
                records.append(Record(PART, f"policy loss fwd+bwd time ({shape})", "ms", tf * 1e3, tb * 1e3, False,
                                      sf * 1e3, sb * 1e3, base, target=target))
                if base in mems and fast in mems:
                    records.append(Record(PART, f"policy loss peak memory beyond inputs/grads ({shape})", "MiB",
                                          mems[fast] / 2**20, mems[base] / 2**20, False, baseline_name=base,
                                          target=20.0 if base == "naive" else None))
        del data, methods
        gc.collect()
        torch.cuda.empty_cache()
    return records


def throughput_records(shape: str, n: int, h: int, v: int, t_fused: float, t_mm: float,
                       device_name: str) -> list[Record]:
    """The fused fwd+bwd's achieved TFLOP/s (8 N H V FLOPs over its time in s) against four
    plain matmuls of the same shapes (target: at most 1.5x their time) and against the
    device's dense bf16 peak (no target; baseline None for a device not in the table)."""
    flops = 8.0 * n * h * v
    fused, mm = flops / t_fused / 1e12, flops / t_mm / 1e12
    peak = dense_bf16_peak(device_name)
    of_peak = "" if peak is None else f" ({fused / peak:.1%} and {mm / peak:.1%} of the {peak:g} TFLOP/s peak)"
    notes = f"8NHV FLOPs; fused {t_fused * 1e3:.1f} ms, {fused:.0f} TFLOP/s; matmuls {t_mm * 1e3:.1f} ms, " \
            f"{mm:.0f} TFLOP/s{of_peak}"
    return [
        Record(PART, f"fused fwd+bwd vs four plain matmuls ({shape})", "TFLOP/s", fused, mm, True,
               baseline_name="torch.matmul x4", target=1 / 1.5, notes=notes),
        Record(PART, f"fused fwd+bwd achieved vs dense bf16 peak ({shape})", "TFLOP/s", fused, peak, True,
               baseline_name=f"peak of {device_name}" if peak is not None else f"peak of {device_name} (unknown)",
               notes=notes + ("" if peak is not None else f"; no dense bf16 peak known for {device_name!r}")),
    ]


def _failure_records(shape: str, fast: str, times: dict, failed: dict, liger_missing: str | None) -> list[Record]:
    """Records for the methods that raised (met=False, with the target their comparison would
    have carried) and for a Liger that did not import (no target)."""
    targets = {fast: 1 / 1.5, "naive": 20.0, LIGER: 2.0}
    t_fast = times[fast][0] * 1e3 if fast in times else float("nan")
    out = []
    for name, err in failed.items():
        flat = " ".join(err.split())  # one line: the name is a table cell
        short = flat if len(flat) <= 160 else flat[:157] + "..."
        out.append(Record(PART, f"policy loss fwd+bwd ({shape}): {name} failed ({short})", "ms", t_fast, None,
                          False, baseline_name="" if name == fast else name, target=targets.get(name), met=False,
                          notes=err))
    if liger_missing is not None:
        out.append(Record(PART, f"policy loss fwd+bwd ({shape}): {LIGER} not measured ({liger_missing})", "ms",
                          t_fast, None, False, baseline_name=LIGER, notes=liger_missing))
    return out


def run(ctx: BenchContext) -> list[Record]:
    """Side-by-side records for `python bench/throughput.py --part kernels`."""
    if ctx.device == "cuda":
        return _cuda(ctx)
    return _cpu(ctx)
