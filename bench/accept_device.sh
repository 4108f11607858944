#!/usr/bin/env bash
# One call on ONE H200 (`nvidia-h200`; torch, no sglang): `tpprobe accept` with the draft on CUDA.
#   1. the GPU test of tests/ranks/test_accept.py: the same accept on cuda and on cpu over the test's
#      trained draft and captures (agreement per position, accept lengths, JSON device/engine);
#   2. the worked example of docs/accept.md, generated here: `tpprobe probe` healthy and
#      `--inject slot-order` (built-in model, 2 gloo ranks), the toy draft trained on the healthy
#      capture (examples/accept_toy_draft.py), then `tpprobe accept ... --device cuda --json` and the
#      same on cpu, wall seconds side by side and the rows compared;
#   3. a draft at a served model's width (random weights, bf16 on disk: WIDE="hidden tokens vocab
#      draft_vocab", default Llama-3-8B's 4096 2048 128256 32000) with the target = the baseline's
#      slots 0 and 1 swapped, `--fix`: the same timings. Its agreement numbers mean nothing (random
#      weights); the cpu and cuda rows must still agree.
#   OUT=dir bash bench/accept_device.sh      (bash scripts/gpu.sh accept runs it)
#   DEVICE=cpu WIDE="256 64 1000 500" OUT=$(mktemp -d) bash bench/accept_device.sh   (the dry run on a CPU machine:
#      cpu stands in for cuda, the GPU test is not run)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-.}; W=$OUT/w; mkdir -p $W
PY=${PY:-python3}
DEV=${DEVICE:-cuda}
WIDE=${WIDE:-"4096 2048 128256 32000"}
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -2
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count() if torch.cuda.is_available() else 0, 'threads', torch.get_num_threads())"
  $PY -c "import sglang" 2>/dev/null && echo "sglang importable" || echo "no sglang (the torch engine runs)"; } > $W/machine.log 2>&1
cat $W/machine.log

secs() { $PY -c "print(f'{$2-$1:.1f}')"; }

if [[ $DEV == cuda* ]]; then
  s=$(date +%s.%N)
  timeout -k 3 ${PYTEST_S:-300} $PY -m pytest -m gpu -p no:cacheprovider -v -rA --basetemp=$W/pt tests/ranks/test_accept.py > $W/pytest-gpu.log 2>&1
  echo "pytest -m gpu tests/ranks/test_accept.py: rc=$? wall=$(secs $s $(date +%s.%N))s"; tail -6 $W/pytest-gpu.log
fi

# 2. the worked example's inputs, made here (docs/accept.md)
E=$W/ex; mkdir -p $E
for name in healthy slot-order; do
  extra=(); [[ $name == healthy ]] || extra=(--inject $name)
  timeout -k 3 120 $PY -m tpprobe probe --backend gloo --nproc 2 --out $E/$name --quiet \
      $($PY -c "from examples.accept_toy_draft import probe_args; print(' '.join(probe_args()))") "${extra[@]}" \
      > $E/probe-$name.log 2>&1 &
done
wait
tail -n 2 $E/probe-*.log
$PY -c "
from pathlib import Path; from examples.accept_toy_draft import capture, train
f, ids = capture(Path('$E/healthy')); print('toy draft:', train(f, ids, Path('$E/draft')))"

# 3. a draft at a served model's width: random weights, a rank file of features and ids per side
$PY - "$W/wide" $WIDE <<'EOF'
import json, sys, torch
from pathlib import Path
from safetensors.torch import save_file
from tpprobe.eagle3.accept import write_draft
out, (h, T, V, DV) = Path(sys.argv[1]), map(int, sys.argv[2:6])
out.mkdir(parents=True, exist_ok=True)
heads, kv = max(1, h // 128), max(1, h // 512)
hd, ffn = h // heads, int(3.5 * h)
g = torch.Generator().manual_seed(0)
def r(*s):
    return (torch.randn(*s, generator=g) * s[-1] ** -0.5).to(torch.bfloat16)
L = "layers.0."
w = {"fc.weight": r(h, 3 * h), "embed_tokens.weight": r(V, h) * 0.02, L + "self_attn.q_proj.weight": r(heads * hd, 2 * h),
     L + "self_attn.k_proj.weight": r(kv * hd, 2 * h), L + "self_attn.v_proj.weight": r(kv * hd, 2 * h),
     L + "self_attn.o_proj.weight": r(h, heads * hd), L + "mlp.gate_proj.weight": r(ffn, h),
     L + "mlp.up_proj.weight": r(ffn, h), L + "mlp.down_proj.weight": r(h, ffn),
     L + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16), L + "hidden_norm.weight": torch.ones(h, dtype=torch.bfloat16),
     L + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16), "norm.weight": torch.ones(h, dtype=torch.bfloat16),
     "lm_head.weight": r(DV, h)}
keep = torch.randperm(V, generator=g)[:DV].sort().values          # the draft vocabulary: DV target ids
w["d2t"] = keep - torch.arange(DV)
w["t2d"] = torch.zeros(V, dtype=torch.bool); w["t2d"][keep] = True
cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h, "intermediate_size": ffn,
       "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd, "num_hidden_layers": 1,
       "vocab_size": V, "draft_vocab_size": DV, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
       "max_position_embeddings": 8192, "tie_word_embeddings": False, "target_hidden_size": h, "torch_dtype": "bfloat16",
       "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}}
write_draft(out / "draft", w, cfg)
ids = torch.randint(0, V, (T,), generator=g)
f = torch.randn(T, 3 * h, generator=g).to(torch.bfloat16)
save_file({"aux.packed": f, "input_ids": ids}, str(out / "baseline.safetensors"))
save_file({"aux.packed": torch.cat([f[:, h:2 * h], f[:, :h], f[:, 2 * h:]], -1).contiguous(), "input_ids": ids},
          str(out / "target.safetensors"))
print(f"wide draft: hidden {h}, {heads} heads / {kv} kv × {hd}, ffn {ffn}, vocab {V} (draft {DV}), {T} tokens, bf16")
EOF

# the CLI on each device, wall seconds (the process: import, load, forward per source, report)
cli() {  # file name, device, args...
  local name=$1 dev=$2; shift 2
  local s=$(date +%s.%N)
  timeout -k 3 300 $PY -m tpprobe accept "$@" --device $dev --json > $W/$name.json 2> $W/$name.err
  echo "$? $(secs $s $(date +%s.%N))"
}
echo "== tpprobe accept --json: --engine torch --device cpu vs --device $DEV (engine auto); wall s of the whole CLI process"
printf "%-8s %7s | %-10s %9s %5s | %-10s %9s %5s\n" case tokens device wall_s rc device wall_s rc
for c in ex wide; do
  if [[ $c == ex ]]; then args=(--draft $E/draft --baseline $E/healthy --target $E/slot-order --fix)
  else args=(--draft $W/wide/draft --baseline $W/wide/baseline.safetensors --target $W/wide/target.safetensors --fix); fi
  read rc_c t_c < <(cli $c-cpu cpu "${args[@]}" --engine torch)     # the engine cuda runs (auto there)
  read rc_g t_g < <(cli $c-dev $DEV "${args[@]}")
  tok=$($PY -c "import json; print(json.load(open('$W/$c-dev.json')).get('tokens'))" 2>/dev/null)
  printf "%-8s %7s | %-10s %9s %5s | %-10s %9s %5s\n" $c "$tok" cpu $t_c $rc_c $DEV $t_g $rc_g
done
echo "== in process: run_accept per device, seconds (load draft and sources, forward per source, --fix; the second call on $DEV is warm)"
$PY - "$W" "$DEV" "$E" <<'EOF'
import json, sys, time, torch
from tpprobe.eagle3.accept import run_accept
W, dev, E = sys.argv[1:4]
cases = {"ex": (f"{E}/draft", f"{E}/healthy", f"{E}/slot-order"),
         "wide": (f"{W}/wide/draft", f"{W}/wide/baseline.safetensors", f"{W}/wide/target.safetensors")}
for c, (d, b, t) in cases.items():
    times, reps = {}, {}
    for name, device in (("cpu", "cpu"), (dev, dev), (dev + " again", dev)):
        s = time.perf_counter()
        reps[name] = run_accept(d, b, t, fix=True, engine="torch", device=device)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times[name] = time.perf_counter() - s
    a, g = reps["cpu"], reps[dev]
    flips = [sum(x != y for x, y in zip(ra["per_position"], rg["per_position"])) for ra, rg in zip(a["rows"], g["rows"])]
    dl = max(abs(ra["accept_length"][k] - rg["accept_length"][k]) for ra, rg in zip(a["rows"], g["rows"])
             for k in ra["accept_length"])
    print(f"{c:5s} {a['tokens']:5d} tokens  " + "  ".join(f"{k}: {v:.2f} s" for k, v in times.items())
          + f"  | positions differing per row {flips}, max accept-length difference {dl:.3f}"
          + f"  | device {g['device']} engine {g['engine'][:60]}")
    print(f"      line ({dev}): {g['line']}")
# the draft's forward alone on each device (warm, best of 3) and its top-1 ids compared position by
# position: at the wide case's random weights agreement says nothing, the ids do
from examples.accept_toy_draft import capture
from tpprobe.eagle3.accept import Eagle3Forward, _ieee_fp32, load_draft
from safetensors.torch import load_file
for c, (d, b, t) in cases.items():
    dr = load_draft(d)
    f, ids = capture(b) if c == "ex" else (lambda x: (x["aux.packed"], x["input_ids"]))(load_file(b))
    top, secs, lg0 = {}, {}, None
    for device in ("cpu", dev):
        eng = Eagle3Forward(dr, torch.device(device))
        x, i = f[:-1].to(device), ids[1:].to(device)
        best = 1e9
        with torch.no_grad(), _ieee_fp32(torch.device(device)):
            for _ in range(3):
                s = time.perf_counter()
                lg = eng.logits(x, i)
                tp = lg.argmax(-1).cpu()
                best = min(best, time.perf_counter() - s)
        top[device], secs[device] = tp, best
        if lg0 is None:
            lg0 = lg
        del eng, lg
    diff = (top["cpu"] != top[dev]).nonzero().flatten()
    t2 = lg0.topk(2, -1).values
    marg = ((t2[:, 0] - t2[:, 1]) / lg0.abs().max())[diff].tolist()
    print(f"{c:5s} forward only ({ids.numel() - 1} positions, draft vocab {dr.draft_vocab}): cpu {secs['cpu']:.3f} s, "
          f"{dev} {secs[dev]:.4f} s ({secs['cpu'] / max(secs[dev], 1e-9):.0f}x); top-1 ids differing: {len(diff)}"
          + (f" at top-2 margins {[f'{m:.1e}' for m in marg[:5]]}" if len(diff) else ""))
EOF
echo "== the JSON of the example on $DEV (device, engine, line)"
$PY -c "
import json; r = json.load(open('$W/ex-dev.json')); c = json.load(open('$W/ex-cpu.json'))
print({k: r.get(k) for k in ('device', 'device_name', 'engine', 'exit_code', 'line')})
print('same rows as cpu:', r['rows'] == c['rows'])"
for f in $W/*.err; do [[ -s $f ]] && { echo "== $f"; tail -5 $f; }; done
tar -czf $OUT/accept.tgz -C $W . 2>/dev/null; rm -rf $W/*; true
