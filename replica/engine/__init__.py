"""The serving engine: paged KV blocks with prefix caching, continuous-batching scheduler, sampler, model runner."""
