/* Register tiles: NR unpacked weight rows x NC activation rows -> res[r * 4 + c]. */
#pragma once
#include "quant.h"

typedef struct {
    int cols_pad;
    int has_min;               /* B is not all zero (st_has_min) */
    const uint8_t *s[4];       /* weight rows: [cols_pad] */
    const float *A[4];         /* [cols_pad / 4] */
    const float *B[4];         /* [cols_pad / 16] */
    const int8_t *q[4];        /* activation rows: [cols_pad] */
    const float *dx[4];        /* [cols_pad / 4] */
    const int32_t *xc[4];      /* [cols_pad / 4] */
    const float *xs[4];        /* [cols_pad / 16] */
} st_qtile;

typedef struct {
    int cols_pad;
    const float *w[4];         /* weight rows: [cols_pad] */
    const float *x[4];         /* activation rows: [cols_pad] */
} st_ftile;

void st_qtile_4x4(const st_qtile *t, float *res);
void st_qtile_4x1(const st_qtile *t, float *res);
void st_qtile_1x4(const st_qtile *t, float *res);
void st_qtile_1x1(const st_qtile *t, float *res);
void st_ftile_4x4(const st_ftile *t, float *res);
void st_ftile_4x1(const st_ftile *t, float *res);
void st_ftile_1x4(const st_ftile *t, float *res);
void st_ftile_1x1(const st_ftile *t, float *res);
