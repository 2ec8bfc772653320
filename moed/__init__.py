"""moed: a serving daemon for large Mixture-of-Experts models."""
__version__ = "0.1.0"
