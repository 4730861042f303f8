"""Weight quantization as pure functions, and the modules that run quantized weights."""
