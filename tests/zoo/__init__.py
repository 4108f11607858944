"""A zoo of TP model shapes that are NOT shaped like the built-in model (issue 13), kept only where they
add a shape the real TP libraries lack (those are probed for real: tests/test_tp_libs.py).

Each module defines small tensor-parallel models written the way another code base writes them,
with its own class names, signatures and reduce paths, and `--model tests.zoo.<module>:<factory>`
factories returning a `ProbeTarget`. Every model has a way to break it on purpose, chosen by the
factory name (`healthy`, `drop` = one reduce of layer `ZOO_LAYER` (default 2) never runs, ...), so
a test can probe it healthy and broken. `ZOO_DTYPE` (float32 | bfloat16) picks the dtype.

  gptj       GPT-J parallel block: attention and MLP in parallel, ONE all-reduce per block, issued
             by the block itself; classes `Embedder`, `Block`, list `h`
  aliased    a reduce bound by an aliased import (`from torch.distributed import all_reduce as ar`)
             on a 2-D [tokens, hidden] stream, in the legacy Megatron-LM names (`encoder.layers`,
             `dense_4h_to_h`): a shape the real libraries lack (megatron-core itself, transformers and
             DTensor TP are probed for real in tests/test_tp_libs.py, with examples/)
  gptfast    gpt-fast `tp.py`: a replicated `nn.Embedding`, `TransformerBlock`s whose `wo` / `w2`
             are plain `nn.Linear` shards reduced in a forward HOOK through functional collectives
  seqpar     sequence parallel: the row-parallel output is reduce-scattered over tokens
             (`reduce_scatter_tensor`) and all-gathered back (`all_gather_into_tensor`)
  moe        an MoE block with a replicated `router` and TP-sharded experts, one reduce per block
  fused      SGLang-like `(hidden, residual)` layers with a fused residual-add + RMSNorm after the
             reduce (a function, as fused kernels are)
"""
