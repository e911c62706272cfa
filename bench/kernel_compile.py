"""Ahead-of-time compile check of fastpo.kernels' Triton kernels for named GPU targets, no GPU needed.

    python bench/kernel_compile.py [--targets 80,90,100] [--json FILE] [--oversized] [--no-cache]

Every Triton kernel of `fastpo.kernels._triton` (the forward `_fwd_kernel`, the backward's
`_dlogits_kernel`, the splits' `_combine_kernel`), for each input dtype (bf16, fp16, fp32),
each autotune config and the fixed config (`FASTPO_TRITON_AUTOTUNE=0`), is compiled with
`triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))` for sm_80 and sm_90 (and
sm_100 where the installed Triton has a ptxas for it). Its PTX then goes through the same
ptxas Triton uses for that target with `-v`, which prints registers per thread and the
bytes of register spill stores and loads. A config passes when it compiles, its shared
memory (Triton's `metadata.shared`, bytes per block) is within the target's per-block limit
and ptxas reports no spill. Occupancy (resident warps per SM over 64) follows from the
registers, the shared memory and the warps per block (the CUDA occupancy rules: registers
allocated per warp in units of 256, 64 Ki registers and 64 warps per SM on sm_80/90/100).

Pointer arguments and row strides are compiled as 16-divisible (what the runtime's
specialization gives for contiguous tensors with H a multiple of 16, e.g. 576, 896, 3584).

Results are cached per config on the kernels' source hash, Triton's version and ptxas's
version (`$FASTPO_KERNEL_COMPILE_CACHE`, default ~/.cache/fastpo/kernel_compile), so a rerun
on unchanged kernels takes seconds. Exit status: 0 when every config passes (and every
`--oversized` config is reported as spilling), 1 otherwise, 2 for bad arguments, 3 when
Triton or ptxas is missing (the reason on stderr).

Works with Triton >= 3.3 (signatures and constexprs by argument name, ptxas from
`triton.backends.nvidia.compiler.get_ptxas(arch)` in 3.5+ or `get_ptxas()` before it);
checked here with Triton 3.9.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings

# Triton 3.9 warns that its FP-fusion default will change; the runtime compiles with its default too.
warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = ("bf16", "fp16", "fp32")
TARGETS = (80, 90, 100)
# Shared memory per block (opt-in maximum) and per SM, bytes (CUDA programming guide,
# compute capabilities 8.0, 9.0, 10.0); 1 KiB per resident block is reserved by the system.
SHARED_PER_BLOCK = {80: 163 * 1024, 90: 227 * 1024, 100: 227 * 1024}
SHARED_PER_SM = {80: 164 * 1024, 90: 228 * 1024, 100: 228 * 1024}
REGS_PER_SM, MAX_WARPS_PER_SM, MAX_BLOCKS_PER_SM, REG_UNIT = 65536, 64, 32, 256
# The default deliberately oversized config (`--oversized`; the test passes its own): a 256 x 256 fp32
# logits tile on 4 warps needs 512 registers per thread for the accumulator alone.
# Checked on sm_90 only (or the first target asked for, without sm_90).
OVERSIZED = ({"kernel": "fwd", "dtype": "bf16", "BLOCK_N": 256, "BLOCK_V": 256, "BLOCK_D": 64,
              "num_warps": 4, "num_stages": 2},)


class Unavailable(RuntimeError):
    """Triton, its NVIDIA backend or ptxas is missing here; the message says which."""


@dataclasses.dataclass(frozen=True)
class Spec:
    kernel: str  # fwd | dlogits | combine
    dtype: str  # the inputs' dtype (bf16 | fp16 | fp32); combine works on fp32 partials only
    target: int  # compute capability, 80 | 90 | 100
    origin: str  # "autotune k", "fixed", "fixed+autotune k" or "oversized"
    constexprs: tuple  # ((name, value), ...)
    num_warps: int
    num_stages: int

    def key(self) -> dict:
        return dict(kernel=self.kernel, dtype=self.dtype, target=self.target, constexprs=dict(self.constexprs),
                    num_warps=self.num_warps, num_stages=self.num_stages)


def _torch_dtype(name: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def kernel_configs(oversized=False) -> list[tuple[str, str, str, dict, int, int]]:
    """(kernel, dtype, origin, constexprs, num_warps, num_stages) of every config the runtime may
    launch: per dtype the fixed config of `_config` and every autotune config (a config that is
    both appears once, origin "fixed+autotune k"); the combine kernel once (fp32 partials).
    oversized: True (OVERSIZED) or dicts like OVERSIZED's, added with origin "oversized"."""
    from fastpo.kernels import _triton as kt

    out = []
    for dtype in DTYPES:
        cfg = kt._config(_torch_dtype(dtype))
        base = {k: cfg[k] for k in ("BLOCK_N", "BLOCK_V", "BLOCK_D", "IEEE", "GROUP_N")}
        fixed = (cfg["BLOCK_N"], cfg["num_warps"], cfg["num_stages"])
        seen = {fixed: "fixed"}
        for i, c in enumerate(kt._TUNE_CONFIGS[cfg["IEEE"]]):
            key = (c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
            seen[key] = f"{seen[key]}+autotune {i}" if key in seen else f"autotune {i}"
        for kernel in ("fwd", "dlogits"):
            for (bn, w, st), origin in seen.items():
                out.append((kernel, dtype, origin, dict(base, BLOCK_N=bn), w, st))
    out.append(("combine", "fp32", "fixed", {"BLOCK": kt.COMBINE_BLOCK}, kt.COMBINE_WARPS, 3))
    if oversized:
        for o in (OVERSIZED if oversized is True else oversized):
            cfg = kt._config(_torch_dtype(o["dtype"]))
            ce = {"BLOCK_N": o["BLOCK_N"], "BLOCK_V": o["BLOCK_V"], "BLOCK_D": o["BLOCK_D"], "IEEE": cfg["IEEE"],
                  "GROUP_N": cfg["GROUP_N"]}
            out.append((o["kernel"], o["dtype"], "oversized", ce, o["num_warps"], o["num_stages"]))
    return out


def specs(targets=(80, 90), oversized: bool = False) -> list[Spec]:
    """Every config of `kernel_configs` for each target; the oversized ones on one target."""
    big = 90 if 90 in targets else targets[0]
    return [Spec(k, d, t, o, tuple(sorted(ce.items())), w, st)
            for t in targets for k, d, o, ce, w, st in kernel_configs(oversized and t == big)]


def _signature(kernel: str, dtype: str) -> tuple[object, dict, set]:
    """(jit function, {arg: Triton type}, names compiled as 16-divisible)."""
    from fastpo.kernels import _triton as kt

    p = "*" + dtype
    if kernel == "fwd":
        fn = kt._fwd_kernel
        types = dict(h_ptr=p, w_ptr=p, tgt_ptr="*i64", part_ptr="*fp32", N="i32", V="i32", D="i32", stride_h="i32",
                     stride_w="i32", inv_temp="fp32", tiles_per_split="i32", n_splits="i32")
    elif kernel == "dlogits":
        fn = kt._dlogits_kernel
        out = "*bf16" if dtype == "bf16" else "*fp32"  # `dlogits_dtype`
        types = dict(h_ptr=p, w_ptr=p, tgt_ptr="*i64", lse_ptr="*fp32", ent_ptr="*fp32", glp_ptr="*fp32",
                     gent_ptr="*fp32", out_ptr=out, N="i32", V="i32", D="i32", v_start="i32", v_len="i32",
                     stride_h="i32", stride_w="i32", stride_o="i32", inv_temp="fp32", N_BUCKET="i32")
    elif kernel == "combine":
        fn = kt._combine_kernel
        types = dict(part_ptr="*fp32", lp_ptr="*fp32", ent_ptr="*fp32", lse_ptr="*fp32", N="i32", n_splits="i32")
    else:
        raise ValueError(f"unknown kernel {kernel!r}")
    divisible = {k for k, t in types.items() if t.startswith("*")} | {"D", "stride_h", "stride_w", "stride_o",
                                                                      "N_BUCKET"}
    return fn, types, divisible & set(types)


def ptxas_for(target: int):
    """(path, version line) of the ptxas that Triton uses for compute capability `target`."""
    try:
        from triton.backends.nvidia import compiler as nv
    except Exception as e:  # no NVIDIA backend in this Triton build
        raise Unavailable(f"triton's NVIDIA backend does not import ({type(e).__name__}: {e})") from e
    tool = None
    if hasattr(nv, "get_ptxas"):
        try:
            tool = nv.get_ptxas(target)  # Triton >= 3.5: a newer ptxas for sm_90+
        except TypeError:
            tool = nv.get_ptxas()
        path = getattr(tool, "path", None) or (tool[0] if isinstance(tool, tuple) else None)
    elif hasattr(nv, "_path_to_binary"):
        path = nv._path_to_binary("ptxas")[0]
    else:
        raise Unavailable("this Triton offers no way to find its ptxas")
    if not path or not os.path.exists(path):
        raise Unavailable(f"no ptxas for sm_{target} here (Triton gave {path!r})")
    out = subprocess.run([path, "--version"], capture_output=True, text=True, encoding="utf-8")
    version = (out.stdout.strip().splitlines() or ["?"])[-1]
    return path, version


def sm_arch(target: int) -> str:
    """ptxas's --gpu-name for a compute capability: the arch-specific 'a' form from sm_90 on (as Triton)."""
    return f"sm_{target}{'a' if target >= 90 else ''}"


_PTXAS_RE = re.compile(r"Used (\d+) registers")
_SPILL_RE = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_STACK_RE = re.compile(r"(\d+) bytes stack frame")


def ptxas_usage(ptx: str, target: int, ptxas: str) -> dict:
    """Registers per thread, spill store/load bytes and stack frame bytes from `ptxas -v` on `ptx`,
    with the flags Triton's own ptxas call uses (-lineinfo, --regAllocOptLevel=2)."""
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w", encoding="utf-8") as f:
            f.write(ptx)
        cmd = [ptxas, "-lineinfo", "-v", "--regAllocOptLevel=2", f"--gpu-name={sm_arch(target)}", src,
               "-o", os.path.join(d, "k.cubin")]
        r = subprocess.run(cmd, capture_output=True, text=True, encoding="utf-8")
        if r.returncode != 0:  # an older ptxas may not know --regAllocOptLevel
            cmd.remove("--regAllocOptLevel=2")
            r = subprocess.run(cmd, capture_output=True, text=True, encoding="utf-8")
    log = r.stdout + r.stderr
    if r.returncode != 0:
        raise RuntimeError(f"ptxas failed ({r.returncode}): {' '.join(log.split())[:400]}")
    regs = [int(x) for x in _PTXAS_RE.findall(log)]
    spills = [(int(a), int(b)) for a, b in _SPILL_RE.findall(log)]
    stack = [int(x) for x in _STACK_RE.findall(log)]
    if not regs:
        raise RuntimeError(f"no register count in ptxas's output: {' '.join(log.split())[:400]}")
    return {"registers": max(regs), "spill_stores": sum(s for s, _ in spills), "spill_loads": sum(l for _, l in spills),
            "stack_frame": max(stack) if stack else 0}


def occupancy(registers: int, shared: int, num_warps: int, target: int) -> dict:
    """Resident blocks per SM and occupancy (resident warps / 64) for a kernel using `registers`
    per thread and `shared` bytes per block, with what limits it."""
    per_warp = -(-max(1, registers) * 32 // REG_UNIT) * REG_UNIT
    limits = {"registers": (REGS_PER_SM // per_warp) // num_warps,
              "shared": SHARED_PER_SM[target] // (shared + 1024),
              "warps": MAX_WARPS_PER_SM // num_warps, "blocks": MAX_BLOCKS_PER_SM}
    blocks = min(limits.values())
    return {"blocks_per_sm": blocks, "occupancy": blocks * num_warps / MAX_WARPS_PER_SM,
            "limited_by": min(limits, key=lambda k: (limits[k], k != "registers"))}


def _compile(spec: Spec) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, types, divisible = _signature(spec.kernel, spec.dtype)
    ce = dict(spec.constexprs)
    sig = {name: (types[name] if name in types else "constexpr") for name in fn.arg_names}
    missing = [n for n in fn.arg_names if n not in types and n not in ce]
    if missing:
        raise RuntimeError(f"no type for {missing} of {spec.kernel} (kernel_compile.py is out of date)")
    target = GPUTarget("cuda", spec.target, 32)
    attrs = None
    try:
        from triton.compiler import make_backend

        backend = make_backend(target)
        attrs = {(fn.arg_names.index(n),): backend.parse_attr("D") for n in divisible}
    except Exception:  # an older Triton: compiled without the divisibility hints
        attrs = None
    src = ASTSource(fn, sig, ce, attrs)
    ck = triton.compile(src, target=target, options={"num_warps": spec.num_warps, "num_stages": spec.num_stages})
    shared = int(getattr(ck.metadata, "shared", 0) or 0)
    return {"ptx": ck.asm["ptx"], "shared": shared}


def check_one(spec: Spec, ptxas: str) -> dict:
    """Compile `spec`, run ptxas -v; a record (dict) with `ok` and, on failure, `error`."""
    rec = dict(spec.key(), origin=spec.origin, arch=sm_arch(spec.target), ok=False, error=None)
    t0 = time.perf_counter()
    try:
        c = _compile(spec)
        use = ptxas_usage(c["ptx"], spec.target, ptxas)
    except Exception as e:  # a kernel that does not compile is a failure to report, not a crash
        rec["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:600]}"
        rec["seconds"] = round(time.perf_counter() - t0, 2)
        return rec
    rec.update(use, shared=c["shared"], shared_limit=SHARED_PER_BLOCK[spec.target],
               **occupancy(use["registers"], c["shared"], spec.num_warps, spec.target))
    rec["spills"] = use["spill_stores"] + use["spill_loads"] > 0
    rec["ok"] = not rec["spills"] and c["shared"] <= SHARED_PER_BLOCK[spec.target]
    if not rec["ok"]:
        why = []
        if rec["spills"]:
            why.append(f"spills {use['spill_stores']} B stores / {use['spill_loads']} B loads")
        if c["shared"] > SHARED_PER_BLOCK[spec.target]:
            why.append(f"shared memory {c['shared']} B > {SHARED_PER_BLOCK[spec.target]} B per block")
        rec["error"] = "; ".join(why)
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    return rec


def source_hash() -> str:
    """sha256 of the kernels' source (fastpo.kernels._triton) and of this script."""
    from fastpo.kernels import _triton as kt

    h = hashlib.sha256()
    for path in (kt.__file__, os.path.abspath(__file__)):
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def _cache_dir() -> str:
    return os.environ.get("FASTPO_KERNEL_COMPILE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fastpo", "kernel_compile")


def _worker(args):
    spec, ptxas = args
    return check_one(spec, ptxas)


def run(targets=(80, 90), oversized: bool = False, use_cache: bool = True, jobs: int = 1,
        kernels: tuple | None = None, dtypes: tuple | None = None) -> dict:
    """Check every config for `targets`; returns {"triton", "ptxas", "source_hash", "records",
    "skipped_targets"}. Raises Unavailable when Triton or every target's ptxas is missing."""
    try:
        import triton
    except Exception as e:
        raise Unavailable(f"triton does not import ({type(e).__name__}: {e})") from e
    ptxas, skipped = {}, {}
    for t in targets:
        try:
            ptxas[t] = ptxas_for(t)
        except Unavailable as e:
            skipped[t] = str(e)
    if not ptxas:
        raise Unavailable("; ".join(f"sm_{t}: {w}" for t, w in skipped.items()))
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
        from triton.runtime.jit import JITFunction
    except Exception as e:
        raise Unavailable(f"this Triton has no ahead-of-time compile API ({type(e).__name__}: {e})") from e
    from fastpo.kernels import _triton as kt

    if not isinstance(kt._fwd_kernel, JITFunction):
        raise RuntimeError("fastpo.kernels._triton was imported under TRITON_INTERPRET=1 (interpreted kernels "
                           "cannot be compiled): run this in a fresh process without it")
    base = hashlib.sha256(f"{source_hash()}|{triton.__version__}".encode())
    todo, records = [], {}
    all_specs = [s for s in specs(tuple(ptxas), oversized)
                 if (not kernels or s.kernel in kernels) and (not dtypes or s.dtype in dtypes)]
    cache = _cache_dir()
    for i, s in enumerate(all_specs):
        key = base.copy()
        key.update(json.dumps([s.key(), ptxas[s.target][1]], sort_keys=True).encode())
        path = os.path.join(cache, key.hexdigest()[:32] + ".json")
        if use_cache and os.path.exists(path):
            try:
                with open(path, encoding="utf-8") as f:
                    records[i] = dict(json.load(f), origin=s.origin, cached=True)
                continue
            except (OSError, ValueError):
                pass
        todo.append((i, s, path))
    work = [(s, ptxas[s.target][0]) for _, s, _ in todo]
    if jobs > 1 and len(work) > 1:
        with concurrent.futures.ProcessPoolExecutor(max_workers=jobs) as ex:
            done = list(ex.map(_worker, work))
    else:
        done = [_worker(w) for w in work]
    for (i, s, path), rec in zip(todo, done):
        records[i] = dict(rec, cached=False)
        if use_cache and (rec["ok"] or rec.get("registers")):  # keep no error from a broken environment
            tmp = f"{path}.{os.getpid()}.tmp"
            try:
                os.makedirs(cache, exist_ok=True)
                with open(tmp, "w", encoding="utf-8") as f:
                    json.dump(rec, f)
                os.replace(tmp, path)
            except OSError as e:  # a read-only home: the check still runs, uncached
                print(f"kernel_compile: not cached ({e})", file=sys.stderr)
    return {"triton": triton.__version__, "ptxas": {f"sm_{t}": v for t, (_, v) in ptxas.items()},
            "source_hash": source_hash(), "records": [records[i] for i in range(len(all_specs))],
            "skipped_targets": {f"sm_{t}": w for t, w in skipped.items()}}


def failures(result: dict) -> list[str]:
    """One line per config that fails: a normal config that does not pass, or an oversized one
    that is not reported as spilling (the check would then be blind)."""
    bad = []
    for r in result["records"]:
        name = (f"{r['kernel']} {r['dtype']} {r['arch']} {r['origin']} "
                f"{dict(r['constexprs'])} warps={r['num_warps']} stages={r['num_stages']}")
        if r["origin"] == "oversized":
            if not r.get("spills"):
                bad.append(f"{name}: expected to spill, reported {r.get('spill_stores')} B spilled"
                           + (f" ({r['error']})" if r.get("error") else ""))
        elif not r["ok"]:
            bad.append(f"{name}: {r['error']}")
    return bad


def table(result: dict) -> str:
    """Markdown table: one row per config (registers, spills, shared memory, occupancy)."""
    rows = ["| kernel | dtype | target | config (BLOCK_N x BLOCK_V x BLOCK_D, warps, stages) | origin | registers | "
            "spill stores / loads (B) | shared (KiB) | blocks/SM | occupancy |", "|" + "---|" * 10]
    for r in result["records"]:
        c = dict(r["constexprs"])
        shape = (f"{c['BLOCK_N']} x {c['BLOCK_V']} x {c['BLOCK_D']}" if "BLOCK_N" in c else f"BLOCK {c['BLOCK']}")
        cfg = f"{shape}, {r['num_warps']} w, {r['num_stages']} st"
        if r.get("registers") is None:
            rows.append(f"| {r['kernel']} | {r['dtype']} | {r['arch']} | {cfg} | {r['origin']} | failed: "
                        f"{r['error']} | | | | |")
            continue
        rows.append(f"| {r['kernel']} | {r['dtype']} | {r['arch']} | {cfg} | {r['origin']} | {r['registers']} | "
                    f"{r['spill_stores']} / {r['spill_loads']} | {r['shared'] / 1024:.1f} | {r['blocks_per_sm']} | "
                    f"{r['occupancy']:.0%} ({r['limited_by']}) |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default="80,90,100",
                    help="compute capabilities, comma-separated (sm_100 is skipped where this Triton has no ptxas "
                         "for it)")
    ap.add_argument("--json", help="write the result here")
    ap.add_argument("--oversized", nargs="?", const="default", default=None, metavar="KERNEL:DTYPE:BN:BV:BD:W:ST",
                    help="also check a deliberately oversized config, which must be reported as spilling (default "
                         "fwd:bf16:256:256:64:4:2)")
    ap.add_argument("--no-cache", action="store_true", help="recompile every config")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="compile processes")
    ap.add_argument("--table", action="store_true", help="print the Markdown table")
    ap.add_argument("--kernels", default="", help="only these kernels (fwd,dlogits,combine; default all)")
    ap.add_argument("--dtypes", default="", help="only these input dtypes (bf16,fp16,fp32; default all)")
    a = ap.parse_args(argv)
    # the compiled kernels, not the interpreter's stand-ins: decided when fastpo.kernels._triton
    # decorates them, so before it is imported
    os.environ.pop("TRITON_INTERPRET", None)
    try:
        targets = tuple(int(t) for t in a.targets.split(",") if t.strip())
    except ValueError:
        print(f"kernel_compile: --targets must be comma-separated integers, got {a.targets!r}", file=sys.stderr)
        return 2
    oversized = None
    if a.oversized == "default":
        oversized = True
    elif a.oversized is not None:
        try:
            k, d, bn, bv, bd, w, st = a.oversized.split(":")
            oversized = ({"kernel": k, "dtype": d, "BLOCK_N": int(bn), "BLOCK_V": int(bv), "BLOCK_D": int(bd),
                          "num_warps": int(w), "num_stages": int(st)},)
            if k not in ("fwd", "dlogits") or d not in DTYPES:
                raise ValueError
        except ValueError:
            print(f"kernel_compile: --oversized must be KERNEL:DTYPE:BN:BV:BD:WARPS:STAGES with KERNEL fwd or "
                  f"dlogits and DTYPE in {DTYPES}, got {a.oversized!r}", file=sys.stderr)
            return 2
    bad_t = [t for t in targets if t not in TARGETS]
    if not targets or bad_t:
        print(f"kernel_compile: --targets must be among {TARGETS}, got {a.targets!r}", file=sys.stderr)
        return 2
    import importlib.util

    if importlib.util.find_spec("fastpo") is None and ROOT not in sys.path:  # a checkout without pip install -e
        sys.path.insert(0, ROOT)
    t0 = time.perf_counter()
    try:
        result = run(targets, oversized, not a.no_cache, max(1, a.jobs),
                     tuple(k for k in a.kernels.split(",") if k), tuple(d for d in a.dtypes.split(",") if d))
    except Unavailable as e:
        print(f"kernel_compile: skipped: {e}", file=sys.stderr)
        return 3
    result["seconds"] = round(time.perf_counter() - t0, 1)
    for t, why in result["skipped_targets"].items():
        print(f"kernel_compile: {t} skipped: {why}", file=sys.stderr)
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    if a.table:
        print(table(result))
    bad = failures(result)
    n = len(result["records"])
    cached = sum(r.get("cached", False) for r in result["records"])
    print(f"kernel_compile: {n - len(bad)} of {n} configs pass ({cached} cached), Triton {result['triton']}, "
          f"{result['seconds']} s", file=sys.stderr)
    for line in bad:
        print(f"kernel_compile: FAIL {line}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
