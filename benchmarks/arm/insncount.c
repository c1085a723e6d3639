/* insncount.c -- a qemu-user plugin that counts the guest's executed instructions, classified
 * from the A64 encoding when a block is translated: all of them; SVE's (op0 = 0010); Advanced
 * SIMD's vector data processing (op0 = x111 with bits 31 and 28 clear: 0Qx0111x); and the other
 * floating-point and SIMD ones (scalar floating point, SIMD scalar, and the loads and stores of
 * FP/SIMD registers: op0 = x1x0 with bit 26 set). Also the multiply-add instructions: FMLA
 * (Advanced SIMD vector and by element, SVE's FMLA and FMAD) and BFMMLA (both), with their
 * float multiply-adds: per instruction for Advanced SIMD, per 128-bit segment for SVE (the caller
 * multiplies by the segments). Inline counters: exact for one guest thread.
 * benchmarks/arm_insns.py builds and uses it (make bench-arm). Debian's qemu-user 7.2 exports
 * the plugin API (version 1) but ships no header: the few declarations used are below. */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

typedef uint64_t qemu_plugin_id_t;
typedef struct qemu_info_t qemu_info_t;
struct qemu_plugin_tb;
struct qemu_plugin_insn;
enum qemu_plugin_op { QEMU_PLUGIN_INLINE_ADD_U64 };
size_t qemu_plugin_tb_n_insns(const struct qemu_plugin_tb *tb);
struct qemu_plugin_insn *qemu_plugin_tb_get_insn(const struct qemu_plugin_tb *tb, size_t idx);
const void *qemu_plugin_insn_data(const struct qemu_plugin_insn *insn);
void qemu_plugin_register_vcpu_tb_trans_cb(qemu_plugin_id_t id,
                                          void (*cb)(qemu_plugin_id_t id, struct qemu_plugin_tb *tb));
void qemu_plugin_register_vcpu_insn_exec_inline(struct qemu_plugin_insn *insn, enum qemu_plugin_op op, void *ptr,
                                                uint64_t imm);
void qemu_plugin_register_atexit_cb(qemu_plugin_id_t id, void (*cb)(qemu_plugin_id_t id, void *userdata),
                                    void *userdata);
void qemu_plugin_outs(const char *string);

__attribute__((visibility("default"))) int qemu_plugin_version = 1;

enum { ALL, SVE, NEON, FP, FMLA, BFMMLA, MAC, MAC_SEG, KINDS };
static uint64_t counts[KINDS];

/* The multiply-add instruction kind of w (FMLA or BFMMLA, else -1) and its multiply-adds:
 * *mac per instruction (Advanced SIMD) or *seg per 128-bit segment (SVE). */
static int mla(uint32_t w, int *mac, int *seg) {
    *mac = *seg = 0;
    const int q = (w >> 30) & 1, sz = (w >> 22) & 1;
    if ((w & 0xBFA0FC00u) == 0x0E20CC00u || (w & 0xBF80F400u) == 0x0F801000u) { /* FMLA (vector, element) */
        *mac = (q ? 4 : 2) >> sz;
        return FMLA;
    }
    if ((w & 0xFFE0FC00u) == 0x6E40EC00u) return *mac = 16, BFMMLA; /* Advanced SIMD BFMMLA */
    if ((w & 0xFFE0FC00u) == 0x6460E400u) return *seg = 16, BFMMLA; /* SVE BFMMLA */
    const uint32_t size = (w >> 22) & 3;
    if ((w & 0xFF20E000u) == 0x65200000u || (w & 0xFF20E000u) == 0x65208000u) { /* SVE FMLA, FMAD */
        *seg = 16 >> size;
        return size ? FMLA : -1;
    }
    if ((w & 0xFFA0FC00u) == 0x64A00000u) { /* SVE FMLA (indexed), .S and .D */
        *seg = (w >> 22) & 1 ? 2 : 4;
        return FMLA;
    }
    return -1;
}

static int kind(uint32_t w) {
    const uint32_t op0 = (w >> 25) & 0xf;
    if (op0 == 2) return SVE;
    if ((op0 & 7) == 7) return ((w >> 31) & 1) == 0 && ((w >> 28) & 1) == 0 ? NEON : FP;
    if ((op0 & 5) == 4 && ((w >> 26) & 1)) return FP;
    return -1;
}

static void on_translate(qemu_plugin_id_t id, struct qemu_plugin_tb *tb) {
    (void)id;
    for (size_t i = 0, n = qemu_plugin_tb_n_insns(tb); i < n; i++) {
        struct qemu_plugin_insn *insn = qemu_plugin_tb_get_insn(tb, i);
        uint32_t w;
        memcpy(&w, qemu_plugin_insn_data(insn), sizeof w);
        qemu_plugin_register_vcpu_insn_exec_inline(insn, QEMU_PLUGIN_INLINE_ADD_U64, &counts[ALL], 1);
        const int k = kind(w);
        if (k >= 0) qemu_plugin_register_vcpu_insn_exec_inline(insn, QEMU_PLUGIN_INLINE_ADD_U64, &counts[k], 1);
        int mac, seg;
        const int m = mla(w, &mac, &seg);
        if (m < 0) continue;
        qemu_plugin_register_vcpu_insn_exec_inline(insn, QEMU_PLUGIN_INLINE_ADD_U64, &counts[m], 1);
        if (mac) qemu_plugin_register_vcpu_insn_exec_inline(insn, QEMU_PLUGIN_INLINE_ADD_U64, &counts[MAC], mac);
        if (seg) qemu_plugin_register_vcpu_insn_exec_inline(insn, QEMU_PLUGIN_INLINE_ADD_U64, &counts[MAC_SEG], seg);
    }
}

static void on_exit(qemu_plugin_id_t id, void *userdata) {
    (void)id, (void)userdata;
    char line[256];
    snprintf(line, sizeof line, "insns all %llu sve %llu neon %llu fp %llu fmla %llu bfmmla %llu mac %llu mac_seg %llu\n",
             (unsigned long long)counts[ALL], (unsigned long long)counts[SVE], (unsigned long long)counts[NEON],
             (unsigned long long)counts[FP], (unsigned long long)counts[FMLA], (unsigned long long)counts[BFMMLA],
             (unsigned long long)counts[MAC], (unsigned long long)counts[MAC_SEG]);
    qemu_plugin_outs(line);
}

__attribute__((visibility("default"))) int qemu_plugin_install(qemu_plugin_id_t id, const qemu_info_t *info,
                                                               int argc, char **argv) {
    (void)info, (void)argc, (void)argv;
    qemu_plugin_register_vcpu_tb_trans_cb(id, on_translate);
    qemu_plugin_register_atexit_cb(id, on_exit, NULL);
    return 0;
}
