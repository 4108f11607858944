"""A zoo of TP model shapes that are NOT shaped like the built-in model, kept only where they
add a shape the real TP libraries lack (those are probed for real: tests/libs/test_tp_libs.py).

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
             DTensor TP are probed for real in tests/libs/test_tp_libs.py, with examples/)
  gptfast    gpt-fast `tp.py`: a replicated `nn.Embedding`, `TransformerBlock`s whose `wo` / `w2`
             are plain `nn.Linear` shards reduced in a forward HOOK through functional collectives
  seqpar     sequence parallel: the row-parallel output is reduce-scattered over tokens
             (`reduce_scatter_tensor`) and all-gathered back (`all_gather_into_tensor`)
  moe        an MoE block with a replicated `router` and TP-sharded experts, one reduce per block
  fused      SGLang-like `(hidden, residual)` layers with a fused residual-add + RMSNorm after the
             reduce (a function, as fused kernels are)

Models made to break one of the probe's checks on purpose (each module says which tests use it):

  a2a            layers that switch sharding with an all-to-all (DeepSpeed-Ulysses style)
  amax           an FP8-style amax sync: MAX / MIN / PRODUCT all-reduces
  blocks         GPT-J blocks that reduce their own sum (nothing row-parallel by structure)
  moe_kinds      a dense layer beside MoE layers with a separately reduced shared expert
  sp_comm        sequence parallel through a communicator of its own above c10d
  disagree       the built-in model with one rank-dependent difference (an extra point, a shape, a dtype)
  crash          the example model with one of tpprobe's own steps broken on rank 1 (internal errors)
  user_model     the "probe your own model" snippet as a user writes it, and a factory that raises
  vllm_gpu_paths vLLM's GPU all-reduce paths made to run on CPU over gloo (the vLLM tier)
"""
