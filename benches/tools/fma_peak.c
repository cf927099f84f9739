// One core's fp32 FMA peak (AVX2): 12 independent chains of 8-lane FMAs (enough to cover the
// FMA latency on two pipes), best of 5 runs, in GFLOP/s. The yardstick for how close a GEMM
// runs to the arithmetic the core can do (docs/engine.md, "the GEMM floor"). Two at once tell
// whether the two vCPUs are two cores (each keeps its rate) or one core's siblings (they halve):
//   gcc -O2 -mavx2 -mfma -o /tmp/fma_peak benches/tools/fma_peak.c
//   /tmp/fma_peak; (/tmp/fma_peak & /tmp/fma_peak; wait)
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc,char**argv){
  long n = 200000000L;
  __m256 a[12]; __m256 x=_mm256_set1_ps(0.999999f), y=_mm256_set1_ps(1e-7f);
  for(int i=0;i<12;i++) a[i]=_mm256_set1_ps((float)i);
  double best=0;
  for(int r=0;r<5;r++){
    double t0=now();
    for(long i=0;i<n/10;i++){
      #pragma GCC unroll 12
      for(int j=0;j<12;j++) a[j]=_mm256_fmadd_ps(a[j],x,y);
    }
    double dt=now()-t0; double g=(n/10)*12.0*16/dt/1e9; if(g>best)best=g;
  }
  float s=0; float o[8]; for(int j=0;j<12;j++){_mm256_storeu_ps(o,a[j]); s+=o[0];}
  printf("%.1f GFLOP/s (checksum %g)\n",best,s);
}
