"""C++ kernels compiled for the host (see build.py), with torch fallbacks for other shapes."""
