/* sve256.c -- sve_instance.h at 256-bit vectors (Neoverse V1: AWS Graviton 3). */
#include "sve_instance.h"
