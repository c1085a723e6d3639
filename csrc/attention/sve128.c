/* sve128.c -- sve_instance.h at 128-bit vectors (Neoverse V2 and N2: AWS Graviton 4, NVIDIA Grace). */
#include "sve_instance.h"
