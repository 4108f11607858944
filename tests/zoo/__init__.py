"""A zoo of TP model shapes that are NOT shaped like the built-in model (issue 13).

Each module defines small tensor-parallel models written the way another code base writes them,
with its own class names, signatures and reduce paths, and `--model tests.zoo.<module>:<factory>`
factories returning a `ProbeTarget`. Every model has a way to break it on purpose, chosen by the
factory name (`healthy`, `drop` = one reduce of layer `ZOO_LAYER` (default 2) never runs, ...), so
a test can probe it healthy and broken. `ZOO_DTYPE` (float32 | bfloat16) picks the dtype.

  gptj       GPT-J parallel block: attention and MLP in parallel, ONE all-reduce per block, issued
             by the block itself; classes `Embedder`, `Block`, list `h`
  megatron   Megatron-LM shape: `VocabParallelEmbedding(input_, position_ids)`, `ParallelTransformer`
             holding `layers` of `ParallelTransformerLayer`; `RowParallelLinear(skip_bias_add=True)`
             reduces with `from torch.distributed import all_reduce as ar` (an aliased import); the
             row-parallel bias is replicated and added after the reduce
  gptfast    gpt-fast `tp.py`: a replicated `nn.Embedding`, `TransformerBlock`s whose `wo` / `w2`
             are plain `nn.Linear` shards reduced in a forward HOOK through functional collectives
  seqpar     sequence parallel: the row-parallel output is reduce-scattered over tokens
             (`reduce_scatter_tensor`) and all-gathered back (`all_gather_into_tensor`)
  moe        an MoE block with a replicated `router` and TP-sharded experts, one reduce per block
  fused      SGLang-like `(hidden, residual)` layers with a fused residual-add + RMSNorm after the
             reduce (a function, as fused kernels are)
"""
