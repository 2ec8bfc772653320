"""Training moed's demo model: a small DeepSeek-V3 (MLA, a dense first layer, grouped sigmoid
routing with the score-correction bias, a shared expert, one MTP module) on the Python standard
library's own sources. Plain torch on the CPU, through transformers' DeepseekV3ForCausalLM (so
the result loads as one) plus the MTP module of mtp.py. `python -m moed.dev.train --help`.

Not on the serving path: nothing under moed/ outside moed/dev imports it (needs the init extra).
"""
