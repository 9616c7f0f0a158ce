"""The request lifecycle: scheduler, KV page allocation, model runner, step loop, detokenizer."""
