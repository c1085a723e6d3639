/* sve2048.c -- sve_instance.h at 2048-bit vectors (no CPU yet; SVE's longest). */
#include "sve_instance.h"
