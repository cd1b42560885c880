// SIMT emulator fake of ATen/cuda/CUDAContext.h.
#pragma once

#include <ATen/cuda/CUDAContextLight.h>
#include <ATen/cuda/Exceptions.h>
#include <c10/cuda/CUDAGuard.h>
