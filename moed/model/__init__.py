"""The model side of moed: checkpoint -> spec + weights -> forward steps over a paged KV cache.

Public entry points (import the submodules; nothing heavy is imported here):
  spec.ModelSpec                     architecture facts (types only; imports nothing of moed)
  hf_config.load_spec                config.json -> ModelSpec (model_type picks the architecture)
  archs.get / supported / kv_layout  architectures by model_type (one module each in archs/)
  kv_layout.KVLayout                 the paged KV cache's entry, shape, bytes and layout id
  context.ComputeContext             device, dtype and whether the CPU kernels serve (once)
  runner.ModelRunner                 loads weights, owns the KV cache, forward(ForwardBatch) -> logits
                                     (and hidden states); kv_layout, kv_region() (what transfer
                                     registers); with mtp=True DeepSeek-V3's MTP layer, forward_mtp
  mtp.mtp_inputs                     the MTP step's batch after a main step (moed/model/mtp.py)
  runner.auto_num_blocks             KV blocks that fit a memory budget
  attention.registry.get_backend     "torch" | "flashinfer" | "auto"
  tokenizer.Tokenizer / IncrementalDetokenizer
  (random-weight checkpoints for tests and benchmarks: moed.dev.checkpoint, a development tool)
"""
