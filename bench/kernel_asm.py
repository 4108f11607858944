"""Compile the fingerprint kernels for sm_90 WITHOUT a GPU and report registers, spills and the
SASS instruction mix of the hot loop (no device time needed).

    python bench/kernel_asm.py [--block-r 16] [--warps 4] [--maxnreg 144] [--dump DIR] [DEPTH=2 ...]

Defaults are launch()'s; KEY=VALUE overrides a constexpr (DEPTH, SPLIT, DT, KP, SKIP, ...).

Needs triton (any machine; its bundled ptxas/nvdisasm do the work)."""
import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from tpprobe.fingerprint.triton import kernels as tf  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def asm_signature(kernel: str, block_r: int, extra: dict):
    """(signature, constexprs, divisible-by-16 args) to compile a kernel offline:
    3 x [8192, 7168] bf16, k = 32, 132 SMs x 3 programs."""
    if kernel == "fp32_kernel":
        sig = {"w_ptr": "*i32", "a_ptr": "*fp32", "fpart_ptr": "*fp32", "ipart_ptr": "*i64",
               "flag_ptr": "*i32", "nwords": "i32", "nbrows": "i32", "brows_per_token": "i32",
               "iters": "i32", "salt_b0": "u32", "NPROG": "i32"}
        const = dict(BLOCK_R=block_r, KP=32, DO_FLAGS=True)
        const.update(extra)
        for name in const:
            sig[name] = "constexpr"
        return sig, const, ("w_ptr", "a_ptr", "nwords")
    if kernel != "fp16_kernel":
        raise ValueError(kernel)
    sig = {"w_ptr": "*i32", "a_ptr": "*fp32", "fpart_ptr": "*fp32", "ipart_ptr": "*i64",
           "flag_ptr": "*i32", "nwords": "i32", "nbrows": "i32", "nfull": "i32",
           "ntiles": "i32", "salt_b0": "u32", "NPROG": "i32", "bpt_m": "i32", "bpt_s": "i32"}
    const = dict(DT=0, BR=block_r, KP=32, DO_FLAGS=True, SPLIT=2, DEPTH=3, SKIP=0, INTERP=False)
    div = ("w_ptr", "a_ptr", "fpart_ptr", "ipart_ptr", "flag_ptr")
    const.update(extra)
    for name in const:
        sig[name] = "constexpr"
    return sig, const, div


def compile_kernel(fn, signature, constexprs, num_warps, num_stages=3, div=(), maxnreg=None):
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div if n in fn.arg_names}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages,
                                   **({"maxnreg": maxnreg} if maxnreg else {})})


def sass_of(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        return subprocess.run([os.path.join(BIN, "nvdisasm"), "-c", f.name], capture_output=True,
                              text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def ptxas_info(ptx: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".ptx", delete=False, mode="w") as f:
        f.write(ptx)
    try:
        r = subprocess.run([os.path.join(BIN, "ptxas"), "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                           capture_output=True, text=True)
        return (r.stdout + r.stderr).strip()
    finally:
        os.unlink(f.name)


def loop_mix(sass: str):
    """Instruction mix of the largest backward-branch loop body."""
    lines = [ln for ln in sass.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", ln)]
    addr = []
    for ln in lines:
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", ln)
        if m:
            addr.append((int(m.group(1), 16), m.group(2).strip()))
    labels = {}
    for ln in sass.splitlines():
        m = re.match(r"\.(L_x_\d+):", ln.strip())
        if m:
            labels[m.group(1)] = None
    best = None
    pos = {a: i for i, (a, _) in enumerate(addr)}
    # label addresses: the line after a label
    cur = None
    laddr = {}
    for ln in sass.splitlines():
        m = re.match(r"\s*\.(L_x_\d+):", ln)
        if m:
            cur = m.group(1)
            continue
        m2 = re.search(r"/\*([0-9a-f]{4,})\*/", ln)
        if m2 and cur:
            laddr[cur] = int(m2.group(1), 16)
            cur = None
    for a, ins in addr:
        m = re.search(r"BRA\s+(?:`\(\.)?(L_x_\d+)", ins)
        if m and m.group(1) in laddr and laddr[m.group(1)] < a:
            n = pos[a] - pos[laddr[m.group(1)]]
            if best is None or n > best[0]:
                best = (n, laddr[m.group(1)], a)
    if best is None:
        return 0, collections.Counter()
    body = [ins for a, ins in addr if best[1] <= a <= best[2]]
    ops = collections.Counter()
    for ins in body:
        ins = re.sub(r"^@!?U?P\w+\s+", "", ins)
        ops[ins.split()[0].split(".")[0]] += 1
    return len(body), ops


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--block-r", type=int, default=16)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--kernel", default="fp16_kernel")
    ap.add_argument("--dump")
    ap.add_argument("--maxnreg", type=int, default=144)
    ap.add_argument("kv", nargs="*")
    a = ap.parse_args()
    extra = {k: int(v) for k, v in (x.split("=") for x in a.kv)}
    fn = getattr(tf, a.kernel)
    sig, const, div = asm_signature(a.kernel, a.block_r, extra)
    k = compile_kernel(fn, sig, const, a.warps, a.stages, div, a.maxnreg)
    sass = sass_of(k.asm["cubin"])
    print(" | ".join(ln.split(": ", 1)[-1] for ln in ptxas_info(k.asm["ptx"]).splitlines() if "Used" in ln
                     or "spill" in ln))
    n, ops = loop_mix(sass)
    # the hot loop is unrolled DEPTH times (one tile each) in the 16-bit kernel
    words = const.get("BR", const.get("BLOCK_R", a.block_r)) * (64 * const.get("DEPTH", 2)
                                                               if a.kernel == "fp16_kernel" else 128)
    print(f"hot loop: {n} SASS instructions per tile of {words} words over {32 * a.warps} threads"
          f" = {n * 32 * a.warps / words:.1f} thread-instr/word")
    print("  " + ", ".join(f"{o} {c}" for o, c in ops.most_common(25)))
    if a.dump:
        os.makedirs(a.dump, exist_ok=True)
        for ext in ("ttgir", "ptx"):
            open(os.path.join(a.dump, f"{a.kernel}.{ext}"), "w").write(k.asm[ext])
        open(os.path.join(a.dump, f"{a.kernel}.sass"), "w").write(sass)


if __name__ == "__main__":
    main()
