"""explore: swimlanes with controls (ipywidgets); every change re-renders the figure,
shown as a PNG so that headless runners (nbconvert) never wait on an Output widget."""
from __future__ import annotations

import inspect

from ..trace import Timeline
from .figure import draw


def explore(source, *, applies=None, **controls):
    """Swimlanes with controls; every change re-renders the figure.

    source: a Timeline, or a function returning one, e.g. a schedule simulator; its
      parameters get controls as in ipywidgets.interact: (lo, hi) -> slider, a list
      -> dropdown, a bool -> checkbox, or pass a widget.
    applies: {control name: function(values) -> bool}: show that control only while it
      applies, e.g. {"v": lambda c: c["schedule"] == "interleaved-1f1b"}; `values` holds
      every control's current value.
    The view checkboxes (comm lanes, arrows, memory) show only when the timeline has
    something for them to show; a time-range slider zooms.

    Returns an ipywidgets VBox; `.update()` re-renders, `.figure` is the figure last
    drawn, `.timeline` the timeline it shows, `.error` the error of the last render (if any).

    The figure is shown as a PNG <img> (its title as alt text) in an HTML widget, not
    displayed into an Output widget: a headless runner (nbconvert) answers each output an
    Output widget captures with a message on the kernel's shell channel, sent while it
    waits on that channel for the cell's reply, and can miss the reply and wait forever.
    """
    import base64
    import html
    import io

    import ipywidgets as w

    if isinstance(source, Timeline):
        if controls:
            raise TypeError(f"controls {sorted(controls)} set parameters of a function that builds a Timeline; "
                            f"explore(timeline) takes none")
        make, sig = (lambda: source), None  # noqa: E731
    elif callable(source):
        make = source
        try:
            sig = inspect.signature(source)
            sig.bind_partial(**controls)
        except TypeError as exc:
            raise TypeError(f"explore: {getattr(source, '__name__', 'source')} cannot take the controls "
                            f"{sorted(controls)}: {exc}") from None
        except ValueError:
            sig = None
    else:
        raise TypeError(f"explore needs a pplab.trace.Timeline, or a function returning one; got {type(source).__name__}")
    unknown = sorted(set(applies or {}) - set(controls))
    if unknown:
        raise TypeError(f"explore: applies= names {unknown}, which are not controls ({sorted(controls)})")

    params = {}
    for name, abbrev in controls.items():
        p = sig.parameters.get(name) if sig is not None else None
        default = p.default if p is not None and p.default is not inspect.Parameter.empty else w.interactive.empty
        widget = w.interactive.widget_from_abbrev(abbrev, default)
        if widget is None:
            raise TypeError(f"explore: no control for {name}={abbrev!r}; use (lo, hi), a list, a bool or a widget")
        if hasattr(widget, "description") and not widget.description:
            widget.description = name
        params[name] = widget
    view = {"comm_lanes": w.Checkbox(True, description="comm lanes"),
            "arrows": w.Checkbox(False, description="send → recv arrows"),
            "memory": w.Checkbox(False, description="memory")}
    time = w.FloatRangeSlider(description="time", min=0.0, max=1.0, value=(0.0, 1.0), step=0.002,
                              continuous_update=False, readout_format=".4g")
    shown = [wd for wd in params.values() if isinstance(wd, w.Widget)]      # w.fixed values are not shown
    # Rows, not one long line: a grid of cells at least 260 px wide, as many per row as fit.
    for wd in shown + list(view.values()) + [time]:
        wd.layout.width = "auto"
        if hasattr(wd, "style") and hasattr(wd.style, "description_width"):
            wd.style.description_width = "initial"
    grid = w.GridBox(shown + list(view.values()), layout=w.Layout(
        grid_template_columns="repeat(auto-fill, minmax(260px, 1fr))", grid_gap="2px 18px", width="100%"))
    image = w.HTML()
    message = w.HTML()
    box = w.VBox([grid, time, message, image], layout=w.Layout(width="100%"))
    box.controls = {**params, **view, "time": time}
    box.image = image
    box.figure = box.timeline = box.error = box.png = None
    state = {"stale": True, "quiet": False}

    def values():
        return {n: wd.value for n, wd in params.items()}

    def show_if(widget, visible):
        widget.layout.display = None if visible else "none"

    def update(change=None, raise_errors=False):
        if state["quiet"]:
            return
        try:
            if state["stale"]:                  # a parameter changed: build the timeline again
                now = values()
                for name, rule in (applies or {}).items():
                    show_if(params[name], rule(now))
                tl = make(**now)
                if not isinstance(tl, Timeline):
                    raise TypeError(f"explore: the source function must return a pplab.trace.Timeline, "
                                    f"got {type(tl).__name__}")
                box.timeline, state["stale"] = tl, False
                show_if(view["comm_lanes"], any(e.category == "comm" for e in tl.events)
                        and any(e.category == "compute" for e in tl.events))
                show_if(view["arrows"], bool(tl.messages()))
                show_if(view["memory"], any(e.category == "memory" for e in tl.events))
                span = tl.makespan if tl.makespan > 0 else 1.0
                state["quiet"] = True           # resetting the slider must not re-render twice
                time.description = f"time ({tl.unit})"
                with time.hold_trait_notifications():
                    time.max, time.min = span, 0.0
                    time.step, time.value = span / 500, (0.0, span)
                state["quiet"] = False
            lo, hi = time.value
            zoom = None if (lo, hi) == (time.min, time.max) else (lo, hi)
            shown_view = {n: c.value for n, c in view.items()}
            shown_view["comm_lanes"] = "auto" if shown_view["comm_lanes"] else False   # no empty lanes
            box.figure = draw(box.timeline, time_range=zoom, **shown_view)
            box.error = None
        except (TypeError, ValueError) as exc:
            state["quiet"] = False
            if raise_errors:
                raise
            box.figure, box.error = None, exc
        if box.figure is not None:
            png = io.BytesIO()
            box.figure.savefig(png, format="png", dpi=80, bbox_inches="tight")
            box.png, title = png.getvalue(), html.escape(box.figure.axes[0].get_title(), quote=True)
            image.value = (f'<img style="max-width: 100%; height: auto" alt="{title}" title="{title}" '
                           f'src="data:image/png;base64,{base64.b64encode(box.png).decode()}">')
            message.value = ""
            show_if(image, True)
        else:
            message.value = f"<pre style='color:#b00'>cannot draw: {html.escape(str(box.error))}</pre>"
            show_if(image, False)

    def param_changed(change):
        state["stale"] = True
        update()

    for wd in shown:
        wd.observe(param_changed, names="value")
    for wd in list(view.values()) + [time]:
        wd.observe(update, names="value")
    box.update = update
    update(raise_errors=True)
    return box
