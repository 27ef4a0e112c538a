"""pplab.planner as a widget: the memory per rank (stacked: parameters, gradients, optimizer
state, activations, one bar per pipeline stage) and the predicted step time's parts.

The figure is shown as a PNG <img> in an HTML widget, not in an Output widget: a headless runner
(nbconvert) can hang on an Output widget's messages (see pplab.swimlane.explore).
"""
from __future__ import annotations

from ..models.gpt import GPTConfig
from .predict import Layout, Prediction, predict, why_not
from .times import LayerTimes, estimate


MODELS = {"tiny GPT (the course's)": dict(layers=2, hidden=32, heads=4, vocab=None),
          "GPT-2 small (124M)": dict(layers=12, hidden=768, heads=12, vocab=50257),
          "GPT-2 XL (1.5B)": dict(layers=48, hidden=1600, heads=25, vocab=50257),
          "7B (32 × 4096)": dict(layers=32, hidden=4096, heads=32, vocab=32000)}
CHECKED = ("Checked against runs: parameters, gradients and optimizer state equal the bytes of the tensors "
           "pplab.hybrid holds (tests/test_planner.py); step times of the tiny GPT at 4 ranks against "
           "benchmarks/hybrid.py. Not checked: activations beyond the tiny GPT, and times of large models "
           "(estimated from FLOPs), which no run here can reach.")
_PARTS = ("params", "grads", "optimizer", "activations")
_TIMES = ("compute", "tp", "bubble", "pp_send", "dp", "optimizer")


def draw(pred: Prediction, budget: float | None = None):
    """Stacked bars of memory per pipeline rank (its stages; every tp and dp rank beside it holds as much) and the step time's parts."""
    import matplotlib.pyplot as plt
    fig, (mem, tim) = plt.subplots(1, 2, figsize=(10, 3.2), gridspec_kw={"width_ratios": [max(2, len(pred.stages)), 3]})
    unit, scale = ("GB", 1e9) if pred.memory["total"] > 1e8 else ("MB", 1e6)
    bottom = [0.0] * len(pred.stages)
    for part in _PARTS:
        values = [st[part] / scale for st in pred.stages]
        mem.bar([f"pp rank {k}" for k in range(len(values))], values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    if budget:
        mem.axhline(budget / scale, color="k", ls="--", lw=1, label="budget")
    mem.set_ylabel(f"{unit} per rank")
    mem.legend(fontsize=7)
    left = 0.0
    for part in _TIMES:
        tim.barh([0], [pred.time[part] * 1e3], left=left, label=part)
        left += pred.time[part] * 1e3
    tim.set_yticks([])
    tim.set_xlabel("predicted step time (ms)")
    tim.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    fig.suptitle(f"{pred.layout.name}: {pred.memory['total'] / scale:.3g} {unit} per rank (the most loaded), "
                 f"{pred.time['total'] * 1e3:.3g} ms per step")
    fig.tight_layout()
    return fig


def widget(fit=None, times: LayerTimes | None = None, flops_per_s: float = 2e10, vocab: int | None = None):
    """Model size, sequence, batch, dp/tp/pp, micro-batches, ZeRO stage -> memory per rank and step time.

    fit: a costfit.Fit (default: costfit.fit(), measured now); times: measured LayerTimes of the
    tiny GPT (used for it only; other models are estimated from FLOPs at flops_per_s).
    Returns an ipywidgets VBox; `.update()` redraws, `.prediction` is the last one shown."""
    import base64
    import html
    import io

    import ipywidgets as w
    import matplotlib.pyplot as plt

    from .. import costfit, data
    fit = fit if fit is not None else costfit.fit(sizes=(1024, 65536, 1 << 20), repeats=3)
    controls = {"model": w.Dropdown(options=list(MODELS), description="model"),
                "seq": w.IntSlider(16, 8, 4096, description="sequence"),
                "batch": w.IntSlider(8, 1, 512, description="batch"),
                "dp": w.IntSlider(2, 1, 16, description="dp"), "tp": w.IntSlider(2, 1, 8, description="tp"),
                "pp": w.IntSlider(1, 1, 8, description="pp"), "m": w.IntSlider(1, 1, 64, description="micro-batches"),
                "zero": w.Dropdown(options=[0, 1, 2, 3], value=0, description="ZeRO stage"),
                "budget_gb": w.FloatLogSlider(2.0, base=10, min=-3, max=2.5, description="GB per rank")}
    image, message = w.HTML(), w.HTML()
    box = w.VBox([w.GridBox(list(controls.values()), layout=w.Layout(
        grid_template_columns="repeat(auto-fill, minmax(260px, 1fr))")), message, image,
        w.HTML(f"<small>{html.escape(CHECKED)}</small>")])
    box.controls, box.prediction, box.error = controls, None, None

    def update(change=None):
        c = {k: wd.value for k, wd in controls.items()}
        shape = dict(MODELS[c["model"]])
        shape["vocab"] = shape["vocab"] or vocab or len(data.VOCAB)
        cfg = GPTConfig(vocab=shape["vocab"], seq=c["seq"], hidden=shape["hidden"], heads=shape["heads"],
                        ffn=(2 if shape["hidden"] == 32 else 4) * shape["hidden"], layers=shape["layers"])
        L = Layout(c["dp"], c["tp"], c["pp"], c["m"] if c["pp"] > 1 else 1, c["zero"] if c["dp"] > 1 else 0)
        why = why_not(cfg, L, c["batch"])
        if why:
            box.error, message.value = why, f"<pre style='color:#b00'>cannot run: {html.escape(why)}</pre>"
            return
        lt = times if times is not None and shape["hidden"] == 32 else estimate(cfg, flops_per_s)
        box.prediction = pred = predict(cfg, L, c["batch"], fit, lt)
        fig = draw(pred, c["budget_gb"] * 1e9)
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=80, bbox_inches="tight")
        plt.close(fig)
        fits = pred.memory["total"] <= c["budget_gb"] * 1e9
        box.error, message.value = None, (f"{cfg.parameters():,} parameters; compute {lt.source}; "
                                          + ("fits" if fits else "<b>does not fit</b>") + " the budget")
        image.value = (f'<img style="max-width: 100%" alt="{html.escape(pred.layout.name)}" '
                       f'src="data:image/png;base64,{base64.b64encode(png.getvalue()).decode()}">')

    for wd in controls.values():
        wd.observe(update, names="value")
    box.update = update
    update()
    return box
