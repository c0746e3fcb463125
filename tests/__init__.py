"""vattn's tests, grouped by the code they guard (one folder a part of vattn); conftest.py
holds the shared fixtures and checks, helpers.py the tiny models and drivers of the engine tests,
fake_cuda/ the strict fake CUDA driver. The files here guard the project as a whole."""
