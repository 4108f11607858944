"""`tpprobe diff BASELINE TARGET`: two runs of the same tokens, slot by slot, with a slot matcher.

BASELINE and TARGET are each a tpprobe capture folder, a SpecForge EAGLE-3 sample (`.ckpt`,
`.ckpt.gz`, `.pt`, loaded with `torch.load(weights_only=True)` only), vLLM's `extract_hidden_states`
file (`{req_id}.safetensors`: hidden_states [tokens, K, hidden], token_ids), a tpprobe rank file, or a
bare `.safetensors` / `.pt` holding one packed [tokens, K*hidden] tensor.

  align   tokens by input_ids: exact, prefix, or a stated --offset; different sequences are refused
  pair    every target slot against every baseline slot (rel diff² = 1 − 2Σtb/(Σt²+Σb²) =
          ‖t−b‖²/(‖t‖²+‖b‖²), float64: quadratic, so a 1 % difference is 5e-5); where a side is a
          capture with the residual stream of every layer, every slot of both sides is also named
          by the stream (or the embedding) it equals
  report  per slot: rel diff, max/mean abs, cosine, ULP, worst token (a bf16 side against a
          float32 side: both as stored and with the float32 side rounded to bf16), and one line
          naming the mapping. Exit 0 when target slot j equals baseline slot j for every j within
          its threshold, 1 otherwise, 2 for unreadable input.

The package, by concern (each module imports only those above it; render reads the report dict only):
  load.py     Side: one source as a packed tensor, its input_ids and residual streams; split into slots
  tokens.py   align: token ranges by input_ids (exact, prefix, --offset)
  compare.py  rel_diff, pair_stats (THE noise rule), thresholds
  match.py    identify, diff_sides: the slot matcher and its verdict
  render.py   the report as a terminal table or JSON
"""
from .compare import DEFAULT_THRESHOLD, default_threshold, pair_stats, parse_thresholds, rel_diff
from .load import Side, load_side, split_slots
from .match import diff_sides, identify
from .render import diff_report, to_json
from .tokens import align

__all__ = ["DEFAULT_THRESHOLD", "Side", "align", "default_threshold", "diff_sides",
           "identify", "load_side", "pair_stats", "parse_thresholds", "diff_report", "rel_diff",
           "split_slots", "to_json"]
