#include "quant.h"
