"""Model integration: mlx-lm models over paged KV, loading, GGUF import."""
