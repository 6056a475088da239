# Run by every Python kernel of airlock's code interpreter at start (IPKernelApp.exec_files):
# the display formatters E2B's code-interpreter template adds, so results carry the same MIME
# types as there: `e2b/data` for pandas DataFrames, `e2b/chart` for matplotlib figures (E2B's
# own e2b-charts package), `application/json` for lists and dicts; PIL images saved to a file
# are displayed too. Everything lives inside one function, so the user's namespace stays clean.


def _airlock_setup():
    import importlib.abc
    import importlib.util
    import json
    import sys

    import IPython
    from IPython.core.formatters import BaseFormatter, JSONFormatter
    from traitlets.traitlets import ObjectName, Unicode

    class DataFrameFormatter(BaseFormatter):
        """`e2b/data`: a DataFrame's columns as lists (timestamps in ISO 8601)."""

        format_type = Unicode("e2b/data")
        print_method = ObjectName("_repr_e2b_data_")
        _return_type = (dict, str)

        def __call__(self, obj):
            pandas = sys.modules.get("pandas")  # no DataFrame without pandas imported
            if pandas is None or not isinstance(obj, pandas.DataFrame):
                return super().__call__(obj)
            columns = obj.to_dict(orient="list")
            return {
                name: [v.isoformat() if isinstance(v, pandas.Timestamp) else v for v in values]
                for name, values in columns.items()
            }

    class ChartFormatter(BaseFormatter):
        """`e2b/chart`: what e2b-charts reads out of a matplotlib figure."""

        format_type = Unicode("e2b/chart")
        print_method = ObjectName("_repr_e2b_chart_")
        _return_type = (dict, str)

        def __call__(self, obj):
            if "matplotlib" not in sys.modules:
                return super().__call__(obj)
            from matplotlib.figure import Figure

            if not isinstance(obj, Figure):
                return super().__call__(obj)
            if not hasattr(Figure, "get_suptitle"):
                # matplotlib 3.8's getter, which e2b-charts reads a figure of several charts
                # (its "superchart") with; Debian 12 ships 3.6.
                Figure.get_suptitle = lambda fig: fig._suptitle.get_text() if fig._suptitle is not None else ""
            try:
                from e2b_charts import chart_figure_to_dict

                return chart_figure_to_dict(obj)
            except Exception:
                return {}

    def plain(value):
        """JSON for numpy scalars and arrays (what orjson's numpy option gives E2B)."""
        for attr in ("tolist", "item", "isoformat"):
            fn = getattr(value, attr, None)
            if callable(fn):
                return fn()
        raise TypeError(f"{type(value).__name__} is not JSON serializable")

    def string_keys(value):
        if isinstance(value, dict):
            return {k if isinstance(k, str) else str(k): string_keys(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [string_keys(v) for v in value]
        return value

    class ListDictJSONFormatter(JSONFormatter):
        """`application/json` for every list and dict, not only objects with `_repr_json_`."""

        def __call__(self, obj):
            if isinstance(obj, (list, dict)):
                try:
                    return json.loads(json.dumps(string_keys(obj), default=plain)), {"expanded": True}
                except (TypeError, ValueError, RecursionError):
                    pass
            return super().__call__(obj)

    ip = IPython.get_ipython()
    formatters = ip.display_formatter.formatters
    formatters["e2b/data"] = DataFrameFormatter(parent=ip.display_formatter)
    formatters["e2b/chart"] = ChartFormatter(parent=ip.display_formatter)
    formatters["application/json"] = ListDictJSONFormatter(parent=ip.display_formatter)

    # No display server here: `Image.show()` must not try to start a viewer, and an image saved
    # to a file is shown as a result instead. Patched when a cell first imports PIL.Image (PIL
    # costs a kernel's start a fifth of its time otherwise).
    def patch_pil(Image):
        from IPython.display import display
        from PIL import ImageShow

        ImageShow.UnixViewer.show_file = lambda self, path, **options: 0
        original_save = Image.Image.save

        def save(image, fp, format=None, **params):
            if isinstance(fp, str):
                display(image)
            return original_save(image, fp, format, **params)

        Image.Image.save = save

    class PatchPILOnImport(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "PIL.Image":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            if spec is None or spec.loader is None:
                return spec
            exec_module = spec.loader.exec_module

            def exec_and_patch(module):
                exec_module(module)
                patch_pil(module)

            spec.loader.exec_module = exec_and_patch
            return spec

    if "PIL.Image" in sys.modules:
        patch_pil(sys.modules["PIL.Image"])
    else:
        sys.meta_path.insert(0, PatchPILOnImport())

_airlock_setup()
del _airlock_setup
