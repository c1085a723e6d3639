/* sve1024.c -- sve_instance.h at 1024-bit vectors (no CPU yet; SVE allows it). */
#include "sve_instance.h"
