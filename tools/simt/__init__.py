"""The SIMT emulator: csrc/cuda/*.cu compiled as host C++ and executed on the CPU."""
