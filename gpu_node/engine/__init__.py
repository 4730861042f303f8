"""The engine: the step loop, the model runner and its CUDA graphs, attention dispatch,
sampling, the prefix cache and the KV handoff between nodes."""
