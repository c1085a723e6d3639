/* sve512.c -- sve_instance.h at 512-bit vectors (A64FX). */
#include "sve_instance.h"
