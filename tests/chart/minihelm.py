"""A minimal renderer for the subset of Helm's Go templates that charts/cuinterpose uses.

There is no ``helm`` binary on our machines (not in Debian, none on PyPI), so the chart tests
render with this. It implements only what the chart's templates use, strictly (anything else
raises ``TemplateError`` naming the template and the action), so a template that needs more
fails its test instead of being rendered wrongly:

- actions ``{{ pipeline }}`` with ``{{-`` / ``-}}`` whitespace trimming, comments ``{{/* */}}``;
- ``if`` / ``else if`` / ``else`` / ``end``, ``with`` / ``else`` / ``end``, ``range`` over a
  list or a mapping (``range $k, $v := ...``), ``define`` / ``include`` / ``template``;
- variables ``$`` and ``$name := ...``; fields ``.A.b`` on the current context;
- functions: default, quote, squote, toYaml, nindent, indent, trunc, trimSuffix, printf (%s,
  %d, %v), eq, ne, not, and, or, empty, required, b64enc, sha256sum, contains, toString, lower, replace, hasKey.

Go template truthiness: false, 0, "", nil, empty list/map are false.
"""

from __future__ import annotations

import base64
import hashlib
import pathlib
import re

import yaml


class TemplateError(Exception):
    pass


TOKEN = re.compile(r"{{(-?)\s*(/\*.*?\*/)?(.*?)\s*(-?)}}", re.S)


def _truthy(v) -> bool:
    return bool(v) if v is not None else False


def _to_yaml(v) -> str:
    if v in ({}, [], None):
        return {dict: "{}", list: "[]"}.get(type(v), "null")
    return yaml.safe_dump(v, default_flow_style=False, sort_keys=True).rstrip("\n")


def _printf(fmt, *args):
    out, i = [], 0
    parts = re.split(r"(%[sdv%])", fmt)
    for p in parts:
        if p == "%%":
            out.append("%")
        elif p in ("%s", "%d", "%v"):
            out.append(str(args[i]))
            i += 1
        else:
            out.append(p)
    return "".join(out)


def _required(msg, v):
    if v in (None, ""):
        raise TemplateError(f"required: {msg}")
    return v


def _fail(msg):
    raise TemplateError(f"fail: {msg}")


FUNCS = {
    "fail": _fail,
    "hasPrefix": lambda pre, s: str(s).startswith(str(pre)),
    "default": lambda d, v=None: v if _truthy(v) else d,
    "quote": lambda v: (
        '"' + str("" if v is None else v).replace("\\", "\\\\").replace('"', '\\"') + '"'
    ),
    "squote": lambda v: "'" + str(v) + "'",
    "toYaml": _to_yaml,
    "nindent": lambda n, s: "\n" + "\n".join((" " * n + l) if l else l for l in str(s).split("\n")),
    "indent": lambda n, s: "\n".join((" " * n + l) if l else l for l in str(s).split("\n")),
    "trunc": lambda n, s: str(s)[:n],
    "trimSuffix": lambda suf, s: str(s)[: -len(suf)] if suf and str(s).endswith(suf) else str(s),
    "printf": _printf,
    "eq": lambda a, b: a == b,
    "ne": lambda a, b: a != b,
    "not": lambda a: not _truthy(a),
    "and": lambda *a: all(_truthy(x) for x in a),
    "or": lambda *a: next((x for x in a if _truthy(x)), a[-1]),
    "empty": lambda a: not _truthy(a),
    "required": _required,
    "b64enc": lambda s: base64.b64encode(str(s).encode()).decode(),
    "toString": lambda v: str(v),
    "lower": lambda s: str(s).lower(),
    "replace": lambda old, new, s: str(s).replace(old, new),
    "hasKey": lambda d, k: isinstance(d, dict) and k in d,
    "contains": lambda sub, s: str(sub) in str(s),
    "sha256sum": lambda s: hashlib.sha256(str(s).encode()).hexdigest(),
}


def _lex(expr: str) -> list[str]:
    toks = re.findall(
        r'"(?:[^"\\]|\\.)*"|`[^`]*`|\(|\)|\||:=|,|\$[A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)*'
        r"|\.[A-Za-z0-9_.]*|-?\d+|[A-Za-z_][A-Za-z0-9_]*|\S",
        expr,
    )
    return toks


class Renderer:
    def __init__(self, templates: dict[str, str]):
        self.templates = templates
        self.defines: dict[str, list] = {}
        self.trees = {name: self._parse(name, text) for name, text in templates.items()}

    # -- parsing ------------------------------------------------------------------------
    def _tokens(self, name, text):
        out, pos = [], 0
        for m in TOKEN.finditer(text):
            lit = text[pos : m.start()]
            if m.group(1):
                lit = lit.rstrip()
            if out and out[-1][0] == "act" and out[-1][2]:
                lit = lit.lstrip()
            out.append(("text", lit, False))
            if m.group(2) and not m.group(3).strip():
                out.append(("act", "", bool(m.group(4))))  # comment
            else:
                out.append(("act", m.group(3).strip(), bool(m.group(4))))
            pos = m.end()
        lit = text[pos:]
        if out and out[-1][0] == "act" and out[-1][2]:
            lit = lit.lstrip()
        out.append(("text", lit, False))
        return out

    def _parse(self, name, text):
        toks = self._tokens(name, text)
        pos = 0

        def block(stop):
            nonlocal pos
            nodes = []
            while pos < len(toks):
                kind, val, _ = toks[pos]
                pos += 1
                if kind == "text":
                    if val:
                        nodes.append(("text", val))
                    continue
                if val == "":
                    continue
                word = val.split()[0]
                if word in stop or (word == "else" and "else" in stop):
                    return nodes, val
                if word in ("if", "with", "range"):
                    body, end = block({"else", "end"})
                    branches = [(val, body)]
                    while end.startswith("else"):
                        rest = end[4:].strip()
                        body, end2 = block({"else", "end"})
                        branches.append((rest or None, body))
                        end = end2
                    nodes.append((word, branches))
                elif word == "define":
                    dname = _lex(val)[1].strip('"')
                    body, _ = block({"end"})
                    self.defines[dname] = body
                elif word == "end":
                    raise TemplateError(f"{name}: unexpected {{{{ end }}}}")
                else:
                    nodes.append(("act", val))
            if stop:
                raise TemplateError(f"{name}: missing {{{{ end }}}}")
            return nodes, None

        nodes, _ = block(set())
        return nodes

    # -- evaluation -----------------------------------------------------------------------
    def render(self, name, root) -> str:
        return self._exec(self.trees[name], root, {"$": root}, name)

    def _exec(self, nodes, dot, vars_, name) -> str:
        out = []
        for node in nodes:
            kind = node[0]
            if kind == "text":
                out.append(node[1])
            elif kind == "act":
                v = self._pipeline(node[1], dot, vars_, name)
                if v is not None and not (isinstance(node[1], str) and ":=" in node[1]):
                    out.append(self._str(v))
            elif kind in ("if", "with"):
                for cond, body in node[1]:
                    if cond is None:
                        out.append(self._exec(body, dot, vars_, name))
                        break
                    expr = cond.split(None, 1)[1] if cond.split()[0] in ("if", "with") else cond
                    if expr.startswith("if "):
                        expr = expr[3:]
                    v = self._pipeline(expr, dot, vars_, name)
                    if _truthy(v):
                        out.append(self._exec(body, v if kind == "with" else dot, vars_, name))
                        break
            elif kind == "range":
                (head, body), *rest = node[1]
                expr = head.split(None, 1)[1]
                kvar = vvar = None
                m = re.match(r"(\$\w+)(?:\s*,\s*(\$\w+))?\s*:=\s*(.*)", expr)
                if m:
                    kvar, vvar, expr = m.group(1), m.group(2), m.group(3)
                    if vvar is None:
                        kvar, vvar = None, kvar
                coll = self._pipeline(expr, dot, vars_, name)
                items = (
                    sorted(coll.items()) if isinstance(coll, dict) else list(enumerate(coll or []))
                )
                if not items and rest:
                    out.append(self._exec(rest[0][1], dot, vars_, name))
                for k, v in items:
                    vv = dict(vars_)
                    if kvar:
                        vv[kvar] = k
                    if vvar:
                        vv[vvar] = v
                    out.append(self._exec(body, v, vv, name))
        return "".join(out)

    def _str(self, v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (dict, list)):
            raise TemplateError(f"printing a {type(v).__name__} without toYaml")
        return str(v)

    def _pipeline(self, expr, dot, vars_, name):
        toks = _lex(expr)
        if len(toks) >= 2 and toks[0].startswith("$") and toks[1] == ":=":
            vars_[toks[0]] = self._eval_tokens(toks[2:], dot, vars_, name)
            return None
        return self._eval_tokens(toks, dot, vars_, name)

    def _eval_tokens(self, toks, dot, vars_, name):
        # split on top-level pipes
        cmds, depth, cur = [], 0, []
        for t in toks:
            if t == "(":
                depth += 1
            elif t == ")":
                depth -= 1
            if t == "|" and depth == 0:
                cmds.append(cur)
                cur = []
            else:
                cur.append(t)
        cmds.append(cur)
        val, have = None, False
        for c in cmds:
            val = self._command(c, dot, vars_, name, (val,) if have else ())
            have = True
        return val

    def _command(self, toks, dot, vars_, name, piped):
        args, i = [], 0
        while i < len(toks):
            t = toks[i]
            if t == "(":
                depth, j = 1, i + 1
                while depth:
                    depth += {"(": 1, ")": -1}.get(toks[j], 0)
                    j += 1
                args.append(("val", self._eval_tokens(toks[i + 1 : j - 1], dot, vars_, name)))
                i = j
                continue
            args.append(("tok", t))
            i += 1
        if not args:
            raise TemplateError(f"{name}: empty command")
        head = args[0]
        if (
            head[0] == "tok"
            and re.fullmatch(r"[A-Za-z_]\w*", head[1])
            and head[1] not in ("true", "false", "nil")
        ):
            fn = head[1]
            vals = [self._atom(a, dot, vars_, name) for a in args[1:]] + list(piped)
            if fn in ("include", "template"):
                tname, ctx = vals[0], vals[1]
                if tname not in self.defines:
                    raise TemplateError(f"{name}: no template {tname!r}")
                return self._exec(self.defines[tname], ctx, {"$": vars_["$"]}, name)
            if fn not in FUNCS:
                raise TemplateError(f"{name}: function {fn!r} not supported by minihelm")
            try:
                return FUNCS[fn](*vals)
            except TemplateError:
                raise
            except Exception as e:
                raise TemplateError(f"{name}: {fn}: {e}") from e
        if len(args) != 1 or piped:
            raise TemplateError(f"{name}: cannot apply {args!r}")
        return self._atom(head, dot, vars_, name)

    def _atom(self, a, dot, vars_, name):
        kind, t = a
        if kind == "val":
            return t
        if t.startswith('"'):
            return bytes(t[1:-1], "utf-8").decode("unicode_escape")
        if t.startswith("`"):
            return t[1:-1]
        if re.fullmatch(r"-?\d+", t):
            return int(t)
        if t in ("true", "false"):
            return t == "true"
        if t == "nil":
            return None
        if t.startswith("$"):
            base, _, path = t.partition(".")
            if base not in vars_:
                raise TemplateError(f"{name}: undefined variable {base}")
            return self._field(vars_[base], path)
        if t.startswith("."):
            return self._field(dot, t[1:])
        raise TemplateError(f"{name}: unexpected {t!r}")

    @staticmethod
    def _field(v, path):
        for p in filter(None, path.split(".")):
            if isinstance(v, dict):
                v = v.get(p)
            else:
                return None
        return v


def deep_merge(base: dict, over: dict) -> dict:
    """Helm's coalescing of user values over the chart's: mappings merge key by key, a null
    removes the key, anything else replaces."""
    out = dict(base)
    for k, v in over.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def render_chart(
    chart_dir,
    values_override: dict | None = None,
    *,
    release="cuinterpose",
    namespace="cuinterpose-system",
) -> dict[str, str]:
    """Render every ``templates/*`` of ``chart_dir`` (not ``_*.tpl``) with values.yaml merged
    with ``values_override``; returns {template file name: rendered text}."""
    chart_dir = pathlib.Path(chart_dir)
    chart = yaml.safe_load((chart_dir / "Chart.yaml").read_text())
    values = yaml.safe_load((chart_dir / "values.yaml").read_text()) or {}
    values = deep_merge(values, values_override or {})
    files = {p.name: p.read_text() for p in sorted((chart_dir / "templates").iterdir())}
    r = Renderer(files)
    root = {
        "Values": values,
        "Release": {"Name": release, "Namespace": namespace, "Service": "Helm"},
        "Chart": {
            "Name": chart["name"],
            "Version": chart["version"],
            "AppVersion": chart.get("appVersion", ""),
        },
    }
    return {n: r.render(n, root) for n in files if not n.startswith("_")}
