"""The engine (vattn.engine) and the attention it runs (vattn.attention): outputs equal
transformers' own, the scheduler, sampling, CUDA graphs, tensor parallelism."""
