"""gmlx: structured decisions from the logits of GGUF models, through llama.cpp."""

__version__ = "0.1.0"
