"""`tpprobe accept --draft DRAFT --baseline A --target B`: what a capture costs in accept length.

The EAGLE-3 draft in DRAFT (an HF folder as SpecForge writes it and SGLang loads it: config.json
with `eagle_config`, safetensors with `fc`, the mid layer, `norm`, `lm_head`, `d2t`/`t2d`) runs
once on A's aux features and once on B's (and with `--fix` on B's slots re-ordered by the slot
matcher of `tpprobe diff`), against the target's token sequence, and the two are compared.

How acceptance is estimated (teacher-forced, from one forward per source):
  The draft at position t reads the target's aux features of token t and the embedding of token
  t+1 (SGLang's draft-extend layout) and proposes token t+2. `agree[t]` = its top-1 (mapped to the
  target vocabulary through d2t) equals token t+2 of the sequence, which is taken to be what the
  target produced (greedy). A chain of k drafted tokens started at t accepts the leading run of
  agree[t], agree[t+1], ..., agree[t+k-1]; the expected number of accepted draft tokens for chain
  length k is that run length averaged over every start t where the whole chain fits. SGLang's
  "accept length" counts the target's own token too: accept length = 1 + accepted drafts.
  Step j > 1 of a real chain reads the draft's own hidden state, not the target's features, so
  this is the estimate with the draft's own steps as good as its first: an upper bound on what a
  served chain accepts, and the same bound for both sources, so their difference is what the
  capture costs.

Engines: `sglang` runs SGLang's own `LlamaForCausalLMEagle3` (CPU, one process, torch_native
attention, an EXTEND batch), `torch` a re-implementation of the same forward
(`Eagle3Forward`, proved equal to SGLang's class on the same weights in tests/ranks/test_accept.py).
`auto` takes sglang when it is importable.

Devices (`--device auto|cpu|cuda[:N]`): `auto` is cuda when torch sees one, else cpu. The torch
engine runs there: its weights, each source's features and the token ids are moved once, the
logits and their argmax stay on the device, and only the per-position top-1 ids come back (the
d2t map and the accept-length arithmetic are the CPU path's). It computes in float32 on every
device, as on CPU (weights and features are upcast; the draft's own dtype is not used), with TF32
off for its matmuls so a GPU run agrees with a CPU run up to float32 rounding. SGLang's class runs
on CPU in this tool: `--engine sglang` with a cuda device is a usage error, and `--engine auto` on
a cuda device takes the torch engine and says so.
"""
