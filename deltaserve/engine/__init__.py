"""The engine: requests, scheduler, cache-aware model runner, sampler, speculative decoding, LLM."""
