// One core's AVX-512 BF16 dot-product rate (`vdpbf16ps`, 64 FLOP each) with 16 independent
// accumulators: operands in registers, then with one broadcast from memory per 1, 2 or 4 dot
// products (the attention and linear kernels' patterns: a K or V pair broadcast against 1, 2 or
// 4 row blocks). Prints G instructions/s and GFLOP/s per pattern (docs/kernels.md, "Prefill
// attention on Zen 4"; docs/engine.md, "Where the rest of the gap sits"):
//   gcc -O2 -mavx512f -mavx512bf16 -o /tmp/dpbf16_peak benches/tools/dpbf16_peak.c
//   /tmp/dpbf16_peak
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static int buf[1024] __attribute__((aligned(64)));
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static void report(const char *what, long n, double s, __m512 *a){
  float r=0; for(int i=0;i<16;i++) r+=_mm512_reduce_add_ps(a[i]);
  printf("%-28s %.2f G vdpbf16ps/s  %.1f GFLOP/s  (%g)\n", what, n/s/1e9, n/s/1e9*64, r);
}
int main(void){
  long n=200000000L;
  __m512 a[16]; for(int i=0;i<16;i++) a[i]=_mm512_setzero_ps();
  __m512bh x=(__m512bh)_mm512_set1_epi32(0x3f803f80), y=(__m512bh)_mm512_set1_epi32(0x3f803f80);
  double t0=now();
  for(long i=0;i<n/16;i++){
    #pragma GCC unroll 16
    for(int j=0;j<16;j++) a[j]=_mm512_dpbf16_ps(a[j],x,y);
    __asm__ volatile("" : "+v"(x));
  }
  report("registers only", n, now()-t0, a);
  t0=now();
  for(long i=0;i<n/16;i++){
    const int *p = buf + (i & 63) * 16;
    #pragma GCC unroll 16
    for(int j=0;j<16;j++) a[j]=_mm512_dpbf16_ps(a[j],(__m512bh)_mm512_set1_epi32(p[j]),x);
    __asm__ volatile("" : "+v"(x));
  }
  report("1 broadcast : 1 dot product", n, now()-t0, a);
  t0=now();
  for(long i=0;i<n/16;i++){
    const int *p = buf + (i & 63) * 8;
    #pragma GCC unroll 8
    for(int j=0;j<8;j++){
      __m512bh k=(__m512bh)_mm512_set1_epi32(p[j]);
      a[j]=_mm512_dpbf16_ps(a[j],k,x); a[8+j]=_mm512_dpbf16_ps(a[8+j],k,y);
    }
    __asm__ volatile("" : "+v"(x), "+v"(y));
  }
  report("1 broadcast : 2 dot products", n, now()-t0, a);
  t0=now();
  for(long i=0;i<n/16;i++){
    const int *p = buf + (i & 63) * 4;
    __m512bh z=x, w=y;
    #pragma GCC unroll 4
    for(int j=0;j<4;j++){
      __m512bh k=(__m512bh)_mm512_set1_epi32(p[j]);
      a[j]=_mm512_dpbf16_ps(a[j],k,x); a[4+j]=_mm512_dpbf16_ps(a[4+j],k,y);
      a[8+j]=_mm512_dpbf16_ps(a[8+j],k,z); a[12+j]=_mm512_dpbf16_ps(a[12+j],k,w);
    }
    __asm__ volatile("" : "+v"(x), "+v"(y));
  }
  report("1 broadcast : 4 dot products", n, now()-t0, a);
  return 0;
}
