"""Development tools: never imported on the serving path.

  cluster.py     `make cluster` / `python -m moed.dev.cluster`: a local five-node cluster
  checkpoint.py  `moed model init`: random-weight Hugging Face checkpoints (tests, benchmarks)
  bpe_train.py   the offline BPE tokenizers and chat templates those checkpoints carry
  train/         the demo model's training (`python -m moed.dev.train`)
"""
