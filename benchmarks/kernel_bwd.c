/* kernel_bwd.c -- the single-pass attention backward, called straight from
 * C (no torch, one thread), timed per tile: the tool to find where the
 * in-place tile costs more than the same products in isolation (see the
 * README's attention performance notes). Float32, causal, D = 64, q/k/v/dout
 * contiguous (B, H, L, D), out and gradients (B, L, H, D) as the shim makes
 * them. Not part of the library or of `make bench`.
 *
 *   F="-O3 -std=c11 -fno-math-errno -Icsrc"
 *   gcc $F -c csrc/attention.c -o /tmp/a.o
 *   gcc $F -mavx512f -mavx512bw -mavx512dq -mavx512vl -mfma -mf16c -c csrc/attention_avx512.c -o /tmp/a512.o
 *   gcc $F -mavx2 -mfma -mf16c -c csrc/attention_avx2.c -o /tmp/a2.o
 *   gcc $F -mavx512f -mavx512bw -mavx512dq -mavx512vl -mavx512bf16 -mamx-tile -mamx-bf16 -mfma -mf16c \
 *       -c csrc/attention_amx.c -o /tmp/amx.o
 *   gcc $F -D_POSIX_C_SOURCE=200809L benchmarks/kernel_bwd.c /tmp/a.o /tmp/a512.o /tmp/a2.o /tmp/amx.o -o /tmp/kernel_bwd -lm
 *   /tmp/kernel_bwd B H L REPS            e.g. 4 8 512 5
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <time.h>
#include "masked_attn.h"
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+1e-9*t.tv_nsec;}
static float frand(void){ /* ~N(0,1) */ float s=0; for(int i=0;i<4;i++) s+=(float)rand()/RAND_MAX-0.5f; return s*1.7f; }
int main(int argc, char **argv) {
  if (argc < 5) { fprintf(stderr, "usage: %s B H L REPS\n", argv[0]); return 2; }
  int64_t B=atoi(argv[1]),H=atoi(argv[2]),L=atoi(argv[3]),D=64; int reps=atoi(argv[4]);
  size_t n=B*H*L*D;
  float *q=aligned_alloc(64,n*4),*k=aligned_alloc(64,n*4),*v=aligned_alloc(64,n*4),*g=aligned_alloc(64,n*4);
  float *out=aligned_alloc(64,n*4),*lse=aligned_alloc(64,B*H*L*4),*dq=aligned_alloc(64,n*4),*dk=aligned_alloc(64,n*4),*dv=aligned_alloc(64,n*4),*delta=aligned_alloc(64,B*H*L*4);
  for(size_t i=0;i<n;i++){q[i]=frand();k[i]=frand();v[i]=frand();g[i]=frand();}
  int64_t st[4]={H*L*D,L*D,D,1}, ost[4]={L*H*D,D,H*D,1}; /* out, grads in (B,L,H,D) */
  ma_attn_fwd_params f; memset(&f,0,sizeof f);
  f.out=out; f.lse=lse; f.q=q; f.k=k; f.v=v; f.dtype=MA_F32; memcpy(f.out_stride,ost,32); memcpy(f.q_stride,st,32); memcpy(f.k_stride,st,32); memcpy(f.v_stride,st,32);
  f.is_causal=1; f.scale=0.125; f.B=B; f.H=H; f.Hkv=H; f.Lq=L; f.Lk=L; f.D=D; f.Dv=D; f.block_q=64; f.block_k=64; f.isa=MA_ISA_AVX512;
  void *fs=aligned_alloc(64, ma_attn_fwd_scratch_bytes(&f)+64); memset(fs,0,64);
  ma_task_ctx fc={&f,fs}; ma_attn_fwd_task(0, ma_attn_fwd_work_items(&f), &fc);
  ma_attn_bwd_params p; memset(&p,0,sizeof p);
  p.dq=dq; p.dk=dk; p.dv=dv; p.dout=g; p.q=q; p.k=k; p.v=v; p.out=out; p.lse=lse; p.dtype=MA_F32;
  memcpy(p.dq_stride,ost,32); memcpy(p.dk_stride,ost,32); memcpy(p.dv_stride,ost,32); memcpy(p.dout_stride,st,32);
  memcpy(p.q_stride,st,32); memcpy(p.k_stride,st,32); memcpy(p.v_stride,st,32); memcpy(p.out_stride,ost,32);
  p.is_causal=1; p.scale=0.125; p.delta=delta; p.kv_chunks=1; p.B=B; p.H=H; p.Hkv=H; p.Lq=L; p.Lk=L; p.D=D; p.Dv=D; p.block_q=64; p.block_k=64; p.isa=MA_ISA_AVX512;
  size_t sb=ma_attn_bwd_scratch_bytes(&p); void *bs=aligned_alloc(64, sb+64);
  int64_t nk=L/64, tiles=B*H*nk*(nk+1)/2; double best=1e9;
  for(int r=0;r<reps;r++){ memset(bs,0,64); ma_task_ctx bc={&p,bs}; double t0=now(); ma_attn_bwd_fused_task(0,B*H,&bc); double t=now()-t0; if(t<best)best=t; }
  printf("B=%ld H=%ld L=%ld: bwd %.2f ms single thread, %.2f us per tile (%ld tiles)\n",(long)B,(long)H,(long)L,best*1e3,best*1e6/tiles,(long)tiles);
}
