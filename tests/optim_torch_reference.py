#!/usr/bin/env python3
"""Reference data for test_optim_torch: runs torch.optim (SGD, Adam, AdamW) with parameter groups,
a learning-rate schedule, torch.nn.utils.clip_grad_norm_ and bf16 parameters with f32 master
weights, and writes the inputs and torch's results to one binary file the C test replays through
ddp_optim and ddp_zero.

usage: optim_torch_reference.py OUT

Layout (little-endian): u32 ncases, then per case:
  char name[32] | i32 kind (0 sgd, 1 adam, 2 adamw) | i32 nesterov | i32 amsgrad |
  i32 dtype (0 f32, 2 f16, 3 bf16) | f64 lr, momentum, dampening, beta1, beta2, eps, weight_decay,
  max_grad_norm | u32 ngroups, ngroups x (f64 lr, f64 weight_decay) |
  u32 nparams, nparams x (u32 numel, u32 group) | u32 nsteps, nsteps x f64 lr factor |
  initial parameters (f32, every parameter in order) |
  per step: gradients (f32), torch's parameters after the step (f32; for bf16 the f32 master),
  f64 norm returned by clip_grad_norm_ (NaN without clipping).
For f16/bf16 cases every initial value and gradient is representable in that type (the C side
stores them exactly) and torch's parameters are the f32 master weights."""
import math
import struct
import sys

try:
    import torch
except ImportError:
    sys.stderr.write("optim_torch_reference.py: cannot import torch; install python3-torch "
                     "(Debian: apt-get install python3-torch)\n")
    sys.exit(2)

SIZES = [37, 35, 7, 1]     # odd, a 5x7 matrix, a bias, a scalar
GROUP_OF = [0, 0, 1, 1]    # biases (group 1): their own lr and no weight decay
FACTORS = [1.0, 0.5, 0.25, 1.0, 0.75, 0.1]  # an LR schedule's multipliers, one per step

CASES = [
    # name, kind, dict of hyperparameters, dtype
    ("sgd_momentum_dampening", 0, dict(momentum=0.9, dampening=0.3, weight_decay=0.01), 0),
    ("sgd_nesterov", 0, dict(momentum=0.8, nesterov=True, weight_decay=0.05), 0),
    ("sgd_plain_clip", 0, dict(max_grad_norm=0.5), 0),
    ("adam_l2", 1, dict(weight_decay=0.02), 0),
    ("adam_amsgrad_clip", 1, dict(amsgrad=True, max_grad_norm=1.0), 0),
    ("adamw", 2, dict(weight_decay=0.1), 0),
    ("adamw_amsgrad", 2, dict(weight_decay=0.05, amsgrad=True, betas=(0.8, 0.95), eps=1e-6), 0),
    ("adamw_clip", 2, dict(weight_decay=0.1, max_grad_norm=0.3), 0),
    ("adamw_bf16_clip", 2, dict(weight_decay=0.1, max_grad_norm=0.8), 3),
    ("sgd_bf16", 0, dict(momentum=0.9, weight_decay=0.01), 3),
    ("adam_f16_amsgrad", 1, dict(weight_decay=0.01, amsgrad=True), 2),
]
BASE_LR = {0: 0.05, 1: 0.01, 2: 0.01}
BIAS_LR_SCALE = 2.0


def f32s(t):
    return struct.pack("<%df" % t.numel(), *t.detach().reshape(-1).tolist())


def main():
    out = open(sys.argv[1], "wb")
    out.write(struct.pack("<I", len(CASES)))
    gen = torch.Generator().manual_seed(1234)
    for name, kind, hp, dtype in CASES:
        lr = BASE_LR[kind]
        momentum = hp.get("momentum", 0.0)
        dampening = hp.get("dampening", 0.0)
        nesterov = hp.get("nesterov", False)
        betas = hp.get("betas", (0.9, 0.999))
        eps = hp.get("eps", 1e-8)
        wd = hp.get("weight_decay", 0.0)
        amsgrad = hp.get("amsgrad", False)
        max_norm = hp.get("max_grad_norm", 0.0)
        groups = [(lr, wd), (lr * BIAS_LR_SCALE, 0.0)]

        def draw(n, scale):
            x = (torch.rand(n, generator=gen, dtype=torch.float64) * 2 - 1) * scale
            x = x.float()
            if dtype == 3:
                return x.bfloat16().float()
            return x.half().float() if dtype == 2 else x

        params = [draw(n, 1.0).requires_grad_(True) for n in SIZES]
        init = [p.detach().clone() for p in params]
        pgroups = [{"params": [p for p, g in zip(params, GROUP_OF) if g == k],
                    "lr": groups[k][0], "weight_decay": groups[k][1]} for k in range(2)]
        if kind == 0:
            opt = torch.optim.SGD(pgroups, lr=lr, momentum=momentum, dampening=dampening,
                                  nesterov=nesterov, weight_decay=wd, foreach=False)
        elif kind == 1:
            opt = torch.optim.Adam(pgroups, lr=lr, betas=betas, eps=eps, weight_decay=wd,
                                   amsgrad=amsgrad, foreach=False)
        else:
            opt = torch.optim.AdamW(pgroups, lr=lr, betas=betas, eps=eps, weight_decay=wd,
                                    amsgrad=amsgrad, foreach=False)
        steps = []
        for factor in FACTORS:
            # LambdaLR's rule: each group's lr is its initial lr times the factor.
            for k, g in enumerate(opt.param_groups):
                g["lr"] = groups[k][0] * factor
            grads = [draw(n, 0.7) for n in SIZES]
            for p, g in zip(params, grads):
                p.grad = g.clone()
            norm = float("nan")
            if max_norm > 0:
                norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
            opt.step()
            steps.append((grads, [p.detach().clone() for p in params], norm))

        out.write(struct.pack("<32s", name.encode()))
        out.write(struct.pack("<4i", kind, int(nesterov), int(amsgrad), dtype))
        out.write(struct.pack("<8d", lr, momentum, dampening, betas[0], betas[1], eps, wd,
                              max_norm))
        out.write(struct.pack("<I", len(groups)))
        for glr, gwd in groups:
            out.write(struct.pack("<2d", glr, gwd))
        out.write(struct.pack("<I", len(SIZES)))
        for n, g in zip(SIZES, GROUP_OF):
            out.write(struct.pack("<2I", n, g))
        out.write(struct.pack("<I", len(FACTORS)))
        for factor in FACTORS:
            out.write(struct.pack("<d", factor))
        for t in init:
            out.write(f32s(t))
        for grads, after, norm in steps:
            for g in grads:
                out.write(f32s(g))
            for p in after:
                out.write(f32s(p))
            out.write(struct.pack("<d", norm))
    out.close()


if __name__ == "__main__":
    main()
