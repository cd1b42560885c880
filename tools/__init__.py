"""Developer tools that are not part of the kaisa package (the SIMT emulator: ``tools.simt``)."""
