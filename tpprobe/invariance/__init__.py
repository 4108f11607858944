"""`tpprobe invariance`: where does bitwise equality across TP sizes and batch sizes break, and
which collective breaks it.

The same prompt runs alone and inside batches of other prompts (packed or padded as the model
batches them: `ProbeTarget.forward_batch`), at every TP size asked for. Each TP size is its own
launch of that many ranks (gloo on CPU, NCCL on GPUs), which runs every batch size in turn under
the probe's Tap. Every capture point (embedding, first layer's input norm, every layer's residual
stream) and every collective (its input on each rank, and the value it produces; at tp 1, where
there is no collective, the output of the module that issues it at tp > 1) is fingerprinted on
the prompt's own token rows only, so a batch never changes the shape compared, and a point costs
a few KB whatever the prompt length. The parent process compares every configuration with the
reference configuration (tp 1 · batch 1 by default) by hash (bitwise) and linear sketch (rounding
noise or material, the probe's noise rule), and names, per configuration, the first row in model
order where bitwise equality breaks and what breaks it:

* a collective whose inputs are bitwise equal on every rank (same TP size) while its output is not:
  the collective itself depends on the message size (an algorithm switch: custom all-reduce vs
  NCCL, channel count, symmetric-memory threshold);
* a collective's output at another TP size: the TP-split reduction (each rank's partial sum over
  its shard, then the collective) adds in another order than the unsplit model;
* anything else: the computation between the last bitwise row and this one (a matmul that
  depends on the number of rows batched, attention over a packed batch, ...).

Files under --out: tp<N>/rank<r>.json (fingerprints), report.json, and with --keep the prompt rows
of every cell that is not bitwise (and the reference's), as safetensors under tensors/.

The modules, in the order they import each other:
  options   the command's options, declared once (typer signature and the ranks' argv derived)
  levels    the schema, the sketch, the levels and how one cell is judged against another
  verdict   the first break of a configuration and its cause; the verdict over the grid
  compare   every configuration against the reference, row by row: the report
  keep      --keep: the tensors of the cells that are not bitwise
  render    its sections of the shared Report (report.json, terminal, --json, --html, --markdown: report/emit.py)
  rank      the rank side: one TP size, every batch size, under the Tap and its audit
  run       the parent: one launch per TP size, then compare and report
Torch-free to import (the command line imports `options`).
"""
