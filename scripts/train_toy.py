"""Train the toy world's models (seeded, CPU). Writes sdvg_engine/toy/weights/*.safetensors + MANIFEST.json.

    python scripts/train_toy.py vae       # tiny Wan VAE as an autoencoder on world clips
    python scripts/train_toy.py reward    # tiny ImageReward regressing ground-truth per-frame adherence
    python scripts/train_toy.py latents   # encode the training clips with the trained VAE (cache in /tmp)
    python scripts/train_toy.py target    # CausalWan target, block-causal flow matching (teacher forcing)
    python scripts/train_toy.py drafter   # CausalWan drafter, same recipe, smaller and shorter
    python scripts/train_toy.py all

Every subcommand is deterministic given --seed and --threads (default 1 thread; torch's CPU kernels are
deterministic at a fixed thread count) and is sized to stay under 30 minutes on 2 shared CPU cores.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sdvg_engine.toy import models as toy_models  # noqa: E402
from sdvg_engine.toy.world import CORRUPTIONS, Scene, all_scenes, corrupt, frame_adherence, render  # noqa: E402

WEIGHTS = toy_models.WEIGHTS
NUM_FRAMES = 45  # 4 blocks of 3 latent frames


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def to_video_tensor(clips: np.ndarray) -> torch.Tensor:
    """[B, T, H, W, 3] 0..1 -> [B, 3, T, H, W] in -1..1."""
    return torch.from_numpy(clips).permute(0, 4, 1, 2, 3).mul(2).sub(1).contiguous()


# ---------------------------------------------------------------------------------------------- VAE
def latent_code(x: torch.Tensor) -> torch.Tensor:
    """[B, 3, T, 32, 32] -> [B, 12, T_lat, 4, 4]: 4x4-average-pooled frames, space-to-depth; latent frame k
    takes the last video frame it covers (0, 4, 8, ...)."""
    x = x[:, :, ::4]
    B, C, T, H, W = x.shape
    y = F.pixel_unshuffle(F.avg_pool2d(x.transpose(1, 2).reshape(B * T, C, H, W), 4), 2)
    return y.reshape(B, T, 12, H // 8, W // 8).transpose(1, 2)


def train_vae(args):
    rng = np.random.default_rng(args.seed)
    torch.manual_seed(args.seed)
    vae = toy_models.build_vae().train()
    if args.resume:  # continue from the shipped weights (the latent statistics are recomputed at the end)
        vae.load_state_dict(toy_models.load_vae().state_dict())
        vae.train().requires_grad_(True)
    opt = torch.optim.Adam(vae.parameters(), lr=args.lr or 2e-3)
    scenes = all_scenes()
    window = 1 + 4 * 3  # 13 frames -> 4 latent frames: the first frame, the first chunk and two steady-state chunks
    began = time.time()
    for step in range(args.steps):
        clips = []
        for _ in range(args.batch):
            s = scenes[rng.integers(len(scenes))]
            clip = render(s, NUM_FRAMES, int(rng.integers(1 << 30)))
            start = 4 * int(rng.integers(0, (NUM_FRAMES - window) // 4 + 1))
            clips.append(clip[start : start + window])
        x = to_video_tensor(np.stack(clips))
        z = vae.encode(x).latent_dist.mean
        z_in = z + 0.02 * z.detach().std() * torch.randn_like(z)  # robustness to generated latents
        out = vae.decode(z_in).sample
        bg = x[:, :, :, :1, :1]
        weight = 1.0 + 10.0 * ((x - bg).abs().sum(1, keepdim=True) > 0.1).float()  # the object is ~8% of the pixels
        rec = (weight * (out - x) ** 2).mean()
        # Auxiliary code: the first 12 latent channels are pulled towards the 8x8 average-pooled frame
        # (space-to-depth into the 4x4 grid), which the encoder otherwise learns very slowly.
        aux = F.mse_loss(z[:, :12], latent_code(x))
        loss = rec + aux
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 5.0)
        for g in opt.param_groups:
            g["lr"] = (args.lr or 2e-3) * min(1.0, (step + 1) / 20) * (0.5 * (1 + math.cos(math.pi * step / args.steps)) * 0.9 + 0.1)
        opt.step()
        if step % 20 == 0 or step == args.steps - 1:
            log(f"vae step {step} rec {rec.item():.4f} aux {aux.item():.4f} ({time.time() - began:.0f}s)")
        if args.max_minutes and time.time() - began > 60 * args.max_minutes:
            log(f"vae: stopping at step {step} (--max-minutes {args.max_minutes})")
            break
    vae.eval()
    # Latent statistics over full clips -> latents_mean / latents_std (the DiT works on normalized latents).
    with torch.no_grad():
        zs = []
        for i, s in enumerate(scenes[:: max(1, len(scenes) // 24)]):
            zs.append(vae.encode(to_video_tensor(render(s, NUM_FRAMES, i)[None])).latent_dist.mean)
        z = torch.cat(zs)
        mean = z.mean(dim=(0, 2, 3, 4))
        std = z.std(dim=(0, 2, 3, 4)).clamp_min(1e-3)
    final = toy_models.build_vae(mean.tolist(), std.tolist())
    final.load_state_dict(vae.state_dict())
    toy_models.save_vae(final, WEIGHTS / toy_models.FILES["vae"])
    toy_models.write_manifest()
    log(f"vae saved; latent std per channel {std.numpy().round(3)}")


# ---------------------------------------------------------------------------------------------- reward
def reward_model_config():
    from sdvg_engine.reward import ImageRewardConfig

    return ImageRewardConfig(image_size=32, patch_size=4, vision_width=48, vision_layers=2, vision_heads=2,
                             vision_mlp_dim=96, text_width=32, text_layers=2, text_heads=2, text_ffn=64,
                             max_position_embeddings=64, proj_dim=16, head_hidden=(64, 32, 16, 8))


def reward_target(adherence: np.ndarray) -> np.ndarray:
    """Score scale the reward model is trained to: 4 * (adherence - 0.5), about -2..2."""
    return 4.0 * (adherence - 0.5)


def reward_batch(rng, scenes, tokenizer, n_clips, frames_per_clip, extra=None):
    pix, ids, masks, ys = [], [], [], []
    for _ in range(n_clips):
        s = scenes[rng.integers(len(scenes))]
        seed = int(rng.integers(1 << 30))
        clip = render(s, NUM_FRAMES, seed)
        if rng.random() > 0.25:
            kind = CORRUPTIONS[rng.integers(len(CORRUPTIONS))]
            clip = corrupt(clip, s, kind, rng, seed=seed)
            if rng.random() < 0.3:  # mild extra degradation (like a VAE decode)
                clip = corrupt(clip, s, "blur", rng)
        idx = rng.integers(0, NUM_FRAMES, size=frames_per_clip)
        i, m = tokenizer(s.caption)
        for t in idx:
            pix.append(clip[t])
            ids.append(i)
            masks.append(m)
            ys.append(frame_adherence(clip[t], s))
    frames = torch.from_numpy(np.stack(pix)).permute(0, 3, 1, 2)
    return frames, torch.cat(ids), torch.cat(masks), torch.tensor(reward_target(np.array(ys)), dtype=torch.float32)


def train_reward(args):
    from sdvg_engine.reward import BlipTokenizer, ImageRewardModel, preprocess_frames

    rng = np.random.default_rng(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    cfg = reward_model_config()
    model = ImageRewardModel(cfg)
    model.init_weights(gen, std=0.1)  # BLIP's 0.02 leaves the image nearly invisible to a 32-wide text CLS
    with torch.no_grad():  # ImageReward's head init (N(0, 1/(in+1)), five linear layers) barely trains from scratch
        for lin in model.mlp.layers:
            if isinstance(lin, torch.nn.Linear):
                lin.weight.normal_(0.0, lin.in_features ** -0.5, generator=gen)
    tokenizer = BlipTokenizer()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr or 1e-3, weight_decay=0.0)
    scenes = all_scenes()
    val = reward_batch(np.random.default_rng(12345), scenes, tokenizer, 64, 2)
    began = time.time()
    for step in range(args.steps):
        frames, ids, masks, y = reward_batch(rng, scenes, tokenizer, args.batch, 1)
        pred, _ = model(preprocess_frames(frames, cfg.image_size), ids, masks)
        loss = F.mse_loss(pred, y)
        opt.zero_grad()
        loss.backward()
        for g in opt.param_groups:
            g["lr"] = (args.lr or 1e-3) * min(1.0, (step + 1) / 50) * (0.5 * (1 + math.cos(math.pi * step / args.steps)) * 0.95 + 0.05)
        opt.step()
        if step % 50 == 0 or step == args.steps - 1:
            with torch.no_grad():
                vp, _ = model(preprocess_frames(val[0], cfg.image_size), val[1], val[2])
                vl = F.mse_loss(vp, val[3]).item()
                corr = float(np.corrcoef(vp.numpy(), val[3].numpy())[0, 1])
            log(f"reward step {step} loss {loss.item():.3f} val {vl:.3f} corr {corr:.3f} ({time.time() - began:.0f}s)")
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(WEIGHTS / toy_models.FILES["reward"]))
    toy_models.write_manifest()
    log("reward saved")


# ---------------------------------------------------------------------------------------------- DiTs
LATENTS_CACHE = Path("/tmp/sdvg_toy_latents.pt")
CLIPS_PER_SCENE = 6


def encode_latents(args):
    """Encode CLIPS_PER_SCENE seeded clips of every scene with the trained VAE (normalized latents)."""
    from sdvg_engine.vae import StreamingWanVAE

    vae = StreamingWanVAE(toy_models.load_vae())
    scenes = all_scenes()
    items = [(i, k) for i in range(len(scenes)) for k in range(CLIPS_PER_SCENE)]
    lat, caps = [], []
    began = time.time()
    with torch.no_grad():
        for j in range(0, len(items), 16):
            chunk = items[j : j + 16]
            clips = np.stack([render(scenes[i], NUM_FRAMES, 1000 + k) for i, k in chunk])
            lat.append(vae.vae.encode(to_video_tensor(clips)).latent_dist.mean)
            caps.extend(i for i, _ in chunk)
            if j % 160 == 0:
                log(f"encoded {j + len(chunk)}/{len(items)} ({time.time() - began:.0f}s)")
    raw = torch.cat(lat)
    # The VAE's latents_mean / latents_std become this training set's per-channel statistics, so that the DiTs
    # work on unit-scale latents (the statistics computed at the end of `vae` on 24 clips were not representative).
    mean, std = raw.mean(dim=(0, 2, 3, 4)), raw.std(dim=(0, 2, 3, 4)).clamp_min(1e-3)
    final = toy_models.build_vae(mean.tolist(), std.tolist())
    final.load_state_dict(vae.vae.state_dict())
    toy_models.save_vae(final, WEIGHTS / toy_models.FILES["vae"])
    toy_models.write_manifest()
    vae = StreamingWanVAE(final.eval())
    latents = vae.normalize(raw)
    torch.save({"latents": latents, "scene_index": torch.tensor(caps)}, LATENTS_CACHE)
    log(f"latents {tuple(latents.shape)} -> {LATENTS_CACHE}; VAE latents_mean/std updated (std {std.numpy().round(3)})")


def caption_rows(caption: str) -> torch.Tensor:
    """The non-zero rows of the caption's context plus one zero (padding) row: [n + 1, 4096]."""
    from sdvg_engine.toy.text import embed_caption

    ctx = embed_caption(caption)[0]
    n = len(caption.split())
    return ctx[: n + 1].clone()


def teacher_forcing_mask(num_frames, fpb, tpf):
    """[2L, 2L] bool for the sequence [clean frames | noisy frames] (True = may attend).

    Clean tokens of block b see clean blocks <= b (the t=0 commit passes); noisy tokens of block b see clean
    blocks < b and the noisy block b itself: exactly what block b sees at inference through the KV cache.
    """
    blk = torch.arange(num_frames).repeat_interleave(tpf) // fpb
    L = blk.numel()
    m = torch.zeros(2 * L, 2 * L, dtype=torch.bool)
    m[:L, :L] = blk[:, None] >= blk[None, :]
    m[L:, :L] = blk[:, None] > blk[None, :]
    m[L:, L:] = blk[:, None] == blk[None, :]
    return m


def train_forward(model, x_clean, x_noisy, t_noisy, rows, pad_count, fpb=3):
    """Flow prediction for ``x_noisy`` [B,C,F,h,w] (per-frame timesteps ``t_noisy`` [B,F]) given clean context.

    Uses the model's own submodules exactly as ``forward_block`` does; the zero text padding rows are
    represented once with a log(count) attention bias (identical softmax, 512x less text work).
    rows: [B, n+1, 4096] (last row zero); pad_count: [B] number of padding rows (512 - n).
    """
    B, C, Fn, h, w = x_noisy.shape
    tpf = model.tokens_per_frame(h, w)
    seq = torch.cat([x_clean, x_noisy], dim=2)
    ts = torch.cat([torch.zeros_like(t_noisy), t_noisy], dim=1)
    x = model.patch_embedding(seq).flatten(2).transpose(1, 2)
    temb, modulation = model._time_embedding(ts)
    cos, sin = model._rope(0, Fn, h // model.config.patch_size[1], w // model.config.patch_size[2], x.device)
    rope = (torch.cat([cos, cos]), torch.cat([sin, sin]))
    mask = teacher_forcing_mask(Fn, fpb, tpf)
    context = model.condition_embedder.text_embedder(rows)
    bias = torch.zeros(B, 1, 1, rows.shape[1])
    bias[:, 0, 0, -1] = torch.log(pad_count.float())
    H = model.num_heads
    n_frames = 2 * Fn

    def per_frame(t):
        return t.view(B, n_frames, tpf, -1)

    for layer, block in enumerate(model.blocks):
        shift, scale, gate, c_shift, c_scale, c_gate = (block.scale_shift_table.float() + modulation).unsqueeze(3).unbind(2)
        normed = (per_frame(block.norm1(x)) * (1 + scale) + shift).flatten(1, 2)
        x = x + (per_frame(model._self_attention(block.attn1, normed, rope, None, layer, 0, mask)) * gate).flatten(1, 2)
        normed = block.norm2(x)
        a2 = block.attn2
        q = a2.norm_q(a2.to_q(normed)).unflatten(2, (H, -1)).transpose(1, 2)
        k = a2.norm_k(a2.to_k(context)).unflatten(2, (H, -1)).transpose(1, 2)
        v = a2.to_v(context).unflatten(2, (H, -1)).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        x = x + a2.to_out[0](out.transpose(1, 2).flatten(2))
        normed = (per_frame(block.norm3(x)) * (1 + c_scale) + c_shift).flatten(1, 2)
        x = x + (per_frame(block.ffn(normed)) * c_gate).flatten(1, 2)
    shift, scale = (model.scale_shift_table.float() + temb.unsqueeze(2)).unsqueeze(3).unbind(2)
    x = (per_frame(model.norm_out(x)) * (1 + scale) + shift).flatten(1, 2)
    x = model.proj_out(x)[:, Fn * tpf :]
    p_t, p_h, p_w = model.config.patch_size
    hp, wp = h // p_h, w // p_w
    x = x.reshape(B, Fn, hp, wp, p_t, p_h, p_w, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
    return x.flatten(6, 7).flatten(4, 5).flatten(2, 3)


def check_train_forward(model, x_clean, x_noisy, t_noisy, caption, fpb=3):
    """Max |difference| between train_forward and the engine's cached block-by-block forward_block."""
    from sdvg_engine.toy.text import embed_caption

    ctx = embed_caption(caption)
    n = len(caption.split())
    with torch.no_grad():
        ours = train_forward(model, x_clean, x_noisy, t_noisy, caption_rows(caption)[None], torch.tensor([512 - n]), fpb)
    text_kv = model.encode_text(ctx)
    _, _, Fn, h, w = x_noisy.shape
    cache = model.new_kv_cache(1, h, w, Fn)
    outs = []
    for b in range(Fn // fpb):
        sl = slice(b * fpb, (b + 1) * fpb)
        outs.append(model.forward_block(x_noisy[:, :, sl], t_noisy[:, sl], text_kv, cache, b * fpb))
        model.forward_block(x_clean[:, :, sl], torch.zeros(1, fpb), text_kv, cache, b * fpb)
    return float((ours - torch.cat(outs, dim=2)).abs().max())


def train_dit(args):
    from sdvg_engine.models.loading import save_checkpoint
    from sdvg_engine.sampling import SELF_FORCING_SCHEDULE

    which = args.which
    if not LATENTS_CACHE.exists():
        encode_latents(args)
    data = torch.load(LATENTS_CACHE)
    latents, scene_index = data["latents"], data["scene_index"]
    scenes = all_scenes()
    rows = torch.stack([caption_rows(s.caption) for s in scenes])  # all captions have 7 words
    pad = torch.tensor([512 - len(s.caption.split()) for s in scenes])
    torch.manual_seed(args.seed + (1 if which == "target" else 2))
    rng = np.random.default_rng(args.seed + (1 if which == "target" else 2))
    model = toy_models.build_dit(which).float().train()
    ema = toy_models.build_dit(which).float().eval().requires_grad_(False)
    ema.load_state_dict(model.state_dict())
    lr = args.lr or 1e-3
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sigmas = torch.tensor(SELF_FORCING_SCHEDULE.sigmas, dtype=torch.float32)
    B, fpb = args.batch, 3
    n_blocks = latents.shape[2] // fpb
    err = check_train_forward(model.eval(), latents[:1], torch.randn_like(latents[:1]),
                              (sigmas[torch.randint(0, 4, (1, n_blocks))] * 1000).repeat_interleave(fpb, 1), scenes[int(scene_index[0])].caption)
    model.train()
    log(f"{which}: {sum(p.numel() for p in model.parameters())} params; train_forward vs forward_block max err {err:.2e}")
    began = time.time()
    for step in range(args.steps):
        idx = torch.from_numpy(rng.integers(0, latents.shape[0], size=B))
        x0 = latents[idx]
        # Per-block noise level: mostly the 4 sampling sigmas, sometimes uniform.
        k = torch.from_numpy(rng.integers(0, 4, size=(B, n_blocks)))
        sig = sigmas[k]
        uni = torch.from_numpy(rng.random((B, n_blocks)) < 0.2)
        sig = torch.where(uni, torch.from_numpy(rng.uniform(0.02, 1.0, (B, n_blocks))).float(), sig)
        sig_f = sig.repeat_interleave(fpb, 1)
        noise = torch.from_numpy(rng.standard_normal(x0.shape).astype(np.float32))
        s5 = sig_f[:, None, :, None, None]
        xt = (1 - s5) * x0 + s5 * noise
        si = scene_index[idx]
        pred = train_forward(model, x0, xt, sig_f * 1000, rows[si], pad[si], fpb)
        loss = F.mse_loss(pred, noise - x0)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / 50) * (0.5 * (1 + math.cos(math.pi * step / args.steps)) * 0.95 + 0.05)
        opt.step()
        with torch.no_grad():
            decay = min(0.995, (1 + step) / (10 + step))
            for pe, pm in zip(ema.parameters(), model.parameters()):
                pe.lerp_(pm, 1 - decay)
        if step % 25 == 0 or step == args.steps - 1:
            log(f"{which} step {step} loss {loss.item():.4f} ({time.time() - began:.0f}s)")
    save_checkpoint(ema, WEIGHTS / toy_models.FILES[which], context_scheme="global_cache")
    toy_models.write_manifest()
    log(f"{which} saved")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["vae", "reward", "latents", "target", "drafter", "all"])
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--resume", action="store_true", help="vae: continue from the shipped weights")
    p.add_argument("--max-minutes", type=float, default=None, help="stop a VAE run early after this long")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    defaults = {"vae": (1200, 4), "reward": (1500, 32), "latents": (0, 0), "target": (360, 4), "drafter": (360, 4)}
    jobs = ["vae", "reward", "latents", "target", "drafter"] if args.what == "all" else [args.what]
    for job in jobs:
        a = argparse.Namespace(**vars(args))
        a.steps = args.steps if args.steps is not None else defaults[job][0]
        a.batch = args.batch if args.batch is not None else defaults[job][1]
        began = time.time()
        fn = {"vae": train_vae, "reward": train_reward, "latents": globals().get("encode_latents"),
              "target": globals().get("train_dit"), "drafter": globals().get("train_dit")}[job]
        a.which = job
        fn(a)
        log(f"{job} done in {time.time() - began:.0f}s")


if __name__ == "__main__":
    main()
