"""Model definitions and checkpoint loading, one file per family (llama, mamba2, rwkv7, maskpredict)."""
