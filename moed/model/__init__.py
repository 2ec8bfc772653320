"""The model side of moed: checkpoint -> spec + weights -> forward steps over a paged KV cache.

Public entry points (import the submodules; nothing heavy is imported here):
  spec.load_spec / ModelSpec         architecture facts from config.json
  runner.ModelRunner                 loads weights, owns the KV cache, forward(ForwardBatch) -> logits
  runner.auto_num_blocks             KV blocks that fit a memory budget
  attention.registry.get_backend     "torch" | "flashinfer" | "auto"; base.kv_bytes_per_block
  tokenizer.Tokenizer / IncrementalDetokenizer
  init.init_checkpoint               random-weight HF checkpoints for tests and benchmarks
"""
