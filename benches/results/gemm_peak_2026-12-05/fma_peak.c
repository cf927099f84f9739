#include <immintrin.h>
#include <stdio.h>
#include <time.h>
#define F(x) x=_mm256_fmadd_ps(x,b,c);
int main(){
  __m256 a0=_mm256_set1_ps(0.1f),a1=a0,a2=a0,a3=a0,a4=a0,a5=a0,a6=a0,a7=a0,a8=a0,a9=a0,a10=a0,a11=a0;
  __m256 b=_mm256_set1_ps(0.9999f), c=_mm256_set1_ps(0.0001f);
  long n=300000000; struct timespec t0,t1; clock_gettime(CLOCK_MONOTONIC,&t0);
  for(long i=0;i<n;i++){ F(a0)F(a1)F(a2)F(a3)F(a4)F(a5)F(a6)F(a7)F(a8)F(a9)F(a10)F(a11) __asm__ volatile("" : "+x"(a0),"+x"(a1),"+x"(a2),"+x"(a3),"+x"(a4),"+x"(a5),"+x"(a6),"+x"(a7),"+x"(a8),"+x"(a9),"+x"(a10),"+x"(a11)); }
  clock_gettime(CLOCK_MONOTONIC,&t1);
  double s=(t1.tv_sec-t0.tv_sec)+(t1.tv_nsec-t0.tv_nsec)*1e-9; float o[8];
  a0=_mm256_add_ps(a0,a11); _mm256_storeu_ps(o,a0);
  printf("%.1f GFLOP/s (%f)\n", n*12.0*16/s/1e9, o[0]);
}
