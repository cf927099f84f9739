#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <stdint.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc,char**argv){
  int nblk=8193, B=12288; int nreq=8, per=1024; int pf=atoi(argv[1]); int mode=atoi(argv[2]);
  char*kv=aligned_alloc(4096,(size_t)nblk*B); memset(kv,1,(size_t)nblk*B);
  int*tab=malloc(sizeof(int)*nreq*per); for(int i=0;i<nreq*per;i++)tab[i]=1+i;
  srand(1); for(int i=nreq*per-1;i>0;i--){int j=rand()%(i+1);int t=tab[i];tab[i]=tab[j];tab[j]=t;}
  char*dst=aligned_alloc(4096,(size_t)nblk*B);
  for(int rep=0;rep<6;rep++){
    double t0=now(); __m256 acc=_mm256_setzero_ps(),acc2=_mm256_setzero_ps();
    for(int r=0;r<nreq;r++) for(int b=0;b<per;b++){
      char*p=kv+(size_t)tab[r*per+b]*B;
      int pd=pf>0?pf:-pf; if(mode<2&&pf&&b+pd/16<per){char*q=kv+(size_t)tab[r*per+b+pd/16]*B; for(int o=0;o<B;o+=64)if(pf>0)_mm_prefetch(q+o,_MM_HINT_T1); else _mm_prefetch(q+o,_MM_HINT_T0);}
      if(mode==0){ for(int o=0;o<B;o+=64){acc=_mm256_add_ps(acc,_mm256_load_ps((float*)(p+o)));acc2=_mm256_add_ps(acc2,_mm256_load_ps((float*)(p+o+32)));} }
      else if(mode==2){ char*q=(b+pd/16<per)?kv+(size_t)tab[r*per+b+pd/16]*B:p; int n=0;
        for(int h=0;h<3;h++) for(int kvh=0;kvh<2;kvh++) for(int t=0;t<16;t++){char*x=p+kvh*6144+t*384+h*128;
          if(pf>0){_mm_prefetch(q+n,_MM_HINT_T1);_mm_prefetch(q+n+64,_MM_HINT_T1);} else {_mm_prefetch(q+n,_MM_HINT_T0);_mm_prefetch(q+n+64,_MM_HINT_T0);} n+=128;
          for(int o=0;o<128;o+=32)acc=_mm256_add_ps(acc,_mm256_load_ps((float*)(x+o)));}
      }
      else { // per head: K rows of head h (128B every 384B) then V rows of head h
        for(int h=0;h<3;h++) for(int kvh=0;kvh<2;kvh++) for(int t=0;t<16;t++){char*x=p+kvh*6144+t*384+h*128;
          for(int o=0;o<128;o+=32)acc=_mm256_add_ps(acc,_mm256_load_ps((float*)(x+o)));}
      }
    }
    double t=now()-t0; float s[8]; _mm256_storeu_ps(s,_mm256_add_ps(acc,acc2));
    printf("pf=%d mode=%d %.2f ms %.1f GB/s (%g)\n",pf,mode,t*1e3,(double)nreq*per*B/t/1e9,s[0]);
  }
  double t0=now(); memcpy(dst,kv,(size_t)nreq*per*B); double t=now()-t0; printf("memcpy %.1f GB/s read\n",(double)nreq*per*B/t/1e9);
}
