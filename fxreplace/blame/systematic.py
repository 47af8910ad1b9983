"""Systematic faults: one kind at fault in several layers (a bug in code every layer runs), told
apart from origins that stand by themselves."""

from __future__ import annotations

import dataclasses

from ..components import LAYER
from ..metrics import EXPLAINS
from ..points import ROUTING as ROUTING_POINT
from ..covers import AFTER_LAYERS, in_layer, own_code
from .passes import Passes
from .result import LayerCode, Origin, SharedClass, Systematic

#: A layer of a systematic kind is at fault when leaving it out of the kind's replacement leaves at least this
#: part of the divergence (or the floor's part, when larger): with the kind replaced in the others, a sound
#: layer computes what the reference does, so leaving it out leaves ~0 (rounding), where a fault leaves its part
MEMBER = 0.01
#: the kind a family's router logits are declared as: the layers holding one are its MoE layers
ROUTER = "router"
#: A class at fault wherever it runs leaves a part wherever its components are left out: each kind's are left out in
#: at most this many groups of neighbouring layers, one at a time (each alone in a model this deep or less). In a deep
#: model one place's part is too small to tell (the fault is spread over as many places), and leaving each out alone
#: would not fit the budget beside the heat map a diffuse verdict needs (a 64-layer model's 128)
LEAVE_OUT = 8


class SystematicKinds(Passes):
    """The search's tests for a systematic kind; an origin beside one is attributed again by the search's
    ``_attribute`` (:class:`fxreplace.blame.search.Search`)."""

    def _repeated_kind(self, origins: list[Origin]) -> str | None:
        """The kind holding origins in two or more layers, or in one beside a layer no kind explained (the same fault
        upstream of that layer can hide its kind there: replacing the kind in it removes only what arises in it, its
        stream all the rest); the most layers, the earliest kind on a tie; else None. None for a drifting target
        without a floor: no scale tells a kind's precision drift from its fault."""
        if self.drifts and self.floor is None:
            return None
        layers = {kind: {o.layer for o in origins if o.component and o.kind == kind} for kind in self.kinds}
        least = 1 if any(o.component is None for o in origins) else 2
        repeated = [kind for kind in self.kinds if len(layers[kind]) >= least]
        return max(repeated, key=lambda kind: len(layers[kind])) if repeated else None

    def _leaving_kinds(self, origins: list[Origin]) -> list[str]:
        """The origins' kinds, the largest origin's first, when the origins together leave at least MEMBER of the
        divergence beyond the floor's part: the same fault in other layers, each adding less than SIGNIFICANT, may be
        what they leave (beside a larger fault of another kind: a flipped router beside an attention bug)."""
        named = [o for o in origins if o.component and o.kind in self.kinds]
        together = self.key(self._replaced(origins))
        if not named or together not in self.cache or 1 - self.E(together) - self.noise < MEMBER:
            return []
        return list(dict.fromkeys(o.kind for o in sorted(named, key=lambda o: -o.share)))

    def _every_kind(self, origins: list[Origin]) -> list[str]:
        """Every kind, in turn, when the origins are two or more layers no kind explains and nothing else: in a deep
        model a kind's bug in every layer leaves each layer part of its error from the faulty layers upstream, which
        its own kind does not remove alone (64 layers of an attention bug read as the layers' own code); one kind
        replaced in every layer tells it (one pass a kind where it does not explain)."""
        return [] if any(o.component for o in origins) or len(origins) < 2 else list(self.kinds)

    def _places(self, origins: list[Origin]) -> int:
        """The places to fix: the origins, a kind holding origins in several layers counted once (a class at fault
        wherever it runs: its components)."""
        if isinstance(self.systematic, (SharedClass, LayerCode)):
            return len([o for o in origins if not self.systematic.holds(o)]) + 1
        repeated = self._repeated_kind(origins)
        return len([o for o in origins if repeated is None or o.kind != repeated]) + (repeated is not None)

    def _kind_wide(self, kind: str, origins: list[Origin]) -> list[str]:
        """``kind`` replaced in every layer holding it, beside the origins of other kinds; not where such an origin
        lies inside it (a router inside the MoE block): replacing the block there would hide it. A layer no kind
        explained is not replaced: its stream would make everything upstream of it the reference's."""
        others = [o.component for o in origins if o.kind != kind and o.component]
        return others + [c.capture_name for c in self._of_kind(kind) if not any(self._inside(n, c) for n in others)]

    def _of_kind(self, kind: str) -> list:
        """The components of ``kind`` in the layers, in layer order."""
        return [c for c in self.components if c.kind == kind and c not in self.feeders]

    def _inside(self, name: str, outer) -> bool:
        """The component ``name`` is a submodule of the component ``outer``, whose replacement hides it; for the
        routing a module is called with, of the block computing it (its router, whose logits it comes from)."""
        inner = self.by_name.get(name)
        where = outer.module_name.rpartition(".")[0] if outer.target.point == ROUTING_POINT else outer.module_name
        return inner is not None and inner is not outer and inner.module_name.startswith(where + ".")

    def _kind_round(self, kind: str, origins: list[Origin]) -> list[list[str]]:
        """The first round telling whether ``kind`` is one systematic fault: it replaced in every layer holding it, the
        origins together, each of the kind's alone and each origin left out of the kind-wide replacement."""
        wide = self._kind_wide(kind, origins)
        names = [o.component for o in origins if o.component]
        return [wide, names] + [[o.component] for o in origins if o.kind == kind] + [
            [n for n in wide if n != name] for name in names]

    def _systematic(self, origins: list[Origin]) -> list[Origin]:
        """The origins, with a kind holding origins in several layers made one systematic fault when replacing it in
        every layer holding it (beside the other origins) explains the divergence; when no kind holds origins in two
        layers and the origins leave MEMBER, each origin's kind is tried so in turn, the largest origin's first; when
        they are only layers no kind explains, every kind (:meth:`_every_kind`). Sets ``self.systematic``.

        Its faulty layers leave at least MEMBER of the divergence when left out of that replacement: with the kind
        replaced in the others, a sound layer computes the reference's values and leaves ~0. So an origin of the kind
        leaving less is dropped (it hid an upstream error), and when its origins leave part of what the kind-wide
        replacement removes, every other layer holding it is left out in turn (one the search passed over, its part
        below SIGNIFICANT); there, a component inside the kind's (its router) explaining what the layer leaves is an
        origin of its own, as the search would name it; where an origin of another kind holds the kind's component
        (the MoE block a search reached before its routing) and leaves nothing itself, the component is left out
        with it (the block replaced hides what it leaves). An origin of another kind stays when leaving it out leaves a
        significant part, attributed again with the faulty layers replaced beside it where the fault acted upstream
        of it (:meth:`_beside_systematic`), and a layer no kind explained goes (the kind explains it). Each faulty
        layer's share is its replacement alone."""
        if self.drifts and self.floor is None:
            return origins  # no scale tells a kind's precision drift from its fault
        repeated = self._repeated_kind(origins)
        for kind in [repeated] if repeated else self._leaving_kinds(origins) or self._every_kind(origins):
            found = self._systematic_of(kind, origins)
            if self.systematic is not None:
                return found
        return origins

    def _systematic_of(self, kind: str, origins: list[Origin]) -> list[Origin]:
        """:meth:`_systematic` for ``kind``."""
        wide = self._kind_wide(kind, origins)
        least = max(MEMBER, self.noise)
        group = {o.component: o for o in origins if o.kind == kind}
        others = {o.component: o for o in origins if o.kind != kind and o.component}

        def without(name, *instead):
            return [n for n in wide if n != name] + list(instead)

        def left(name, *instead):  # what leaving ``name`` out of the kind-wide replacement (``instead`` in) leaves
            return self.E(wide) - self.E(without(name, *instead))

        # the kind's component inside an origin of another kind in its layer (the routing inside the MoE block a search
        # reached first) leaves nothing alone, the block replaced there: where the block leaves nothing either, the
        # kind's component is left out with it
        holder = {c.capture_name: o for c in self._of_kind(kind) for o in others
                  if self.by_name[o].layer == c.layer and self._inside(c.capture_name, self.by_name[o])}

        def left_here(name):  # what leaving the kind's ``name`` out leaves, with the origin holding it where it hid it
            outer = holder.get(name)
            if outer is None or left(outer) >= least:
                return left(name)
            return self.E(wide) - self.E([n for n in wide if n not in (name, outer)])

        self.measure(self._kind_round(kind, origins) + [[n for n in wide if n not in pair] for pair in holder.items()])
        if not self._explains(wide):
            return origins  # the kind is not the whole story: its origins stand as found
        passed = []
        if self.E(wide) - self.E([*others, *group]) >= least:
            passed = [c for c in self._of_kind(kind) if c.capture_name in wide and c.capture_name not in group]
        inner = {c.capture_name: [x for x in self.components if x.layer == c.layer and self._inside(x.capture_name, c)]
                 for c in passed}
        self.measure([without(c.capture_name) for c in passed] + [[c.capture_name] for c in passed]
                     + [without(name, x.capture_name) for name, xs in inner.items() for x in xs])
        leaving = [c for c in self._of_kind(kind)
                   if (c.capture_name in group or c in passed) and left_here(c.capture_name) >= least]
        within = {}  # a passed layer's component inside the kind's that explains what the layer leaves
        for c in leaving:
            if c.capture_name in holder:
                continue  # (the block holding it replaced: nothing inside it leaves a part)
            explaining = [x for x in inner.get(c.capture_name, []) if left(c.capture_name, x.capture_name) < least]
            if explaining:
                within[c.capture_name] = explaining[0]
        faulty = [c for c in leaving if c.capture_name not in within]
        if len(faulty) < 2:
            return origins
        kept = self._beside_systematic([x.capture_name for x in within.values()] + [c.capture_name for c in faulty],
                                       list(others.values()), wide)
        chosen = ([o.component for o in kept] + [x.capture_name for x in within.values()]
                  + [c.capture_name for c in faulty])
        self.measure([chosen] + [[n for n in chosen if n != x.capture_name] for x in within.values()])

        def beside_all(x) -> Origin:
            """``x`` as an origin sharing what the others replaced beside it leave without it."""
            beside = [n for n in chosen if n != x.capture_name]
            return Origin(x.layer, self.E(chosen) - self.E(beside), x.capture_name, x.kind,
                          [k.kind for k in self._kinds(x.layer)], sorted(beside))

        # each sharing what its replacement alone removes: below 0 where that alone makes the target worse
        # (faults that interact, e.g. a norm offset in every layer), as the table's row shows it
        members = [dataclasses.replace(group[c.capture_name], share=self.E([c.capture_name], signed=True), beside=[])
                   if c.capture_name in group else Origin(c.layer, self.E([c.capture_name], signed=True),
                                                          c.capture_name, kind, [k.kind for k in self._kinds(c.layer)])
                   for c in faulty]
        where, every = self._where(kind, [c.layer for c in faulty])
        self.systematic = Systematic(kind, [c.layer for c in faulty], [c.capture_name for c in faulty], where, every,
                                     self.E(chosen), [o.share for o in members],
                                     [left_here(c.capture_name) for c in faulty], self.E(wide),
                                     self._cover_words(faulty[0].capture_name))
        return members + kept + [beside_all(x) for x in within.values()]

    def _outside_words(self, layer: int) -> str:
        """What no kind spans in ``layer``: "model.layers.2 (LlamaDecoderLayer)'s own forward", and any module there
        no component's cover holds ("post_feedforward_layernorm (RMSNorm)"); "" when not known."""
        own = self.covers.get(own_code(self.streams[layer].module_name)) if layer in self.streams else None
        if own is None:
            return ""
        (name, cls), *rest = own.spanned
        return ", ".join([f"{name} ({cls})'s own forward"] + [f"{in_layer(n)} ({c})" for n, c in rest])

    def _cover_words(self, name: str) -> str:
        cover = self.covers.get(name)
        return cover.words() if cover else ""

    def _shared_class(self, origins: list[Origin], after_layers: float | None) -> list[Origin]:
        """The origins as one class at fault wherever it runs, when no kind is one systematic fault and they do not
        explain the divergence: a port's RMSNorm class is run by every layer's attention and MLP and by the final
        norm, so its bug is origins of several kinds in many layers and a part after the layers, which read as
        drift. Each class that the covers (:mod:`fxreplace.covers`) of two or more kinds run is tried, the
        model's own before torch's: every component running it replaced (the outermost in a layer: a router
        inside its block goes with it), and each left out in turn (in a deep model, groups of neighbouring layers':
        LEAVE_OUT). It is the fault when that explains what arises in the layers (all of it or, where the class
        runs after the layers too, what the stream after the last layer explains) and, of every kind, more than
        half of those left out leave at least MEMBER (the floor's part when larger): a class runs in every place,
        where independent faults leave their own places only (and one instance may matter little: a norm before a
        near-uniform attention). Classes the same components run (an RMSNorm and Linear) are named together:
        replacing cannot tell them apart. Tried within the budget only, leaving what a diffuse verdict's heat map
        measures. Sets ``self.systematic``."""
        if self.systematic is not None or not self.covers or not origins or (self.drifts and self.floor is None):
            return origins
        named = self._replaced(origins)
        if self.key(named) in self.cache and self.E(named) >= EXPLAINS:
            return origins
        after = self.covers.get(AFTER_LAYERS)
        inner = [c for c in self.components if c.kind != LAYER and c not in self.feeders and c.capture_name in self.covers]
        groups: dict[tuple, list[str]] = {}
        for cls in sorted(set().union(*(self.covers[c.capture_name].classes for c in inner)),
                          key=lambda cls: (cls in self.covers[inner[0].capture_name].framework, cls)):
            running = [c for c in inner if cls in self.covers[c.capture_name].classes]
            outer = [c for c in running if not any(self._inside(c.capture_name, x) for x in running if x is not c)]
            if len({c.kind for c in outer}) >= 2:
                groups.setdefault(tuple(c.capture_name for c in outer), []).append(cls)
        least = max(MEMBER, self.noise)
        heat_map = [[c.capture_name] for c in self.components]
        for names, classes in groups.items():
            names = list(names)
            members = [self.by_name[n] for n in names]
            kinds = list(dict.fromkeys(c.kind for c in members))
            tried = [group for kind in kinds
                     for group in _neighbours([c.capture_name for c in members if c.kind == kind])]
            rounds = [names] + [[n for n in names if n not in group] for group in tried]
            if len(self.passes) + len({self.key(r) for r in rounds + heat_map} - self.cache.keys()) > self.budget:
                break  # too many to tell: the origins stand as found
            self.measure(rounds)
            runs_after = after is not None and classes[0] in after.classes and after_layers is not None
            whole = after_layers if runs_after else 1.0
            explained = self.E(names)
            left = [explained - self.E([n for n in names if n not in group]) for group in tried]
            # most places of every kind (an instance may matter little: a norm before a near-uniform attention)
            leaving = {kind: [part >= least for group, part in zip(tried, left) if self.by_name[group[0]].kind == kind]
                       for kind in kinds}
            if explained < EXPLAINS * whole or not all(2 * sum(v) > len(v) for v in leaving.values()):
                continue
            layers = sorted({c.layer for c in members})
            where, every = self._where(kinds[0], layers)
            first = [c for c in members if c.layer == layers[0]]
            self.systematic = SharedClass(
                " and ".join(f"the {kind}" for kind in kinds), layers, names, where, every, explained, [], left,
                explained, self._cover_words(names[0]), classes,
                [m for c in first for m in self.covers[c.capture_name].holding(classes[0])],
                after.holding(classes[0]) if runs_after else [], whole, least,
                [self.covers[names[0]].qualified(cls) or names[0] for cls in classes], tried)
            alone = {group[0]: part for group, part in zip(tried, left) if len(group) == 1}
            return [Origin(c.layer, alone.get(c.capture_name), c.capture_name, c.kind,
                           [k.kind for k in self._kinds(c.layer)], sorted(set(names) - {c.capture_name}))
                    for c in members]
        return origins

    def _layers_own_code(self, origins: list[Origin]) -> list[Origin]:
        """The origins no kind explains, in two or more layers, as one fault in the layer class's own forward, when
        no other systematic fault is found: nothing else in those layers lies outside the kinds' covers (else a
        module there, a post-feedforward norm, may hold each one's part: they stand as found) and the layers run
        one class. Every layer's stream is measured (one round); the faulty layers are those whose part (what their
        stream adds to the one below) is at least MEMBER (the floor's part when larger: a sound layer adds ~0 in
        float32) and whose kinds' origins, if any, leave at least that much of it: there the class's code acts too,
        and such an origin is its reach, not a source of its own (a layer returning its block's output beside the
        residual, as vLLM's do, hands that block's replacement part of what the layer got wrong). Sets
        ``self.systematic``."""
        unexplained = [o for o in origins if o.component is None]
        if (self.systematic is not None or not self.covers or len(unexplained) < 2
                or (self.drifts and self.floor is None)):
            return origins
        own = {k: self.covers.get(own_code(self.streams[k].module_name)) for k in self.stream_layers}

        def layer_code_only(k) -> bool:  # the layer's own forward is all that lies outside the kinds' covers
            return own[k] is not None and len(own[k].spanned) == 1

        classes = {own[o.layer].top[0][1] for o in unexplained if layer_code_only(o.layer)}
        if len(classes) != 1 or not all(layer_code_only(o.layer) for o in unexplained):
            return origins
        (cls,) = classes
        streams = [[self.streams[k].capture_name] for k in self.stream_layers]
        if len(self.passes) + len({self.key(r) for r in streams} - self.cache.keys()) > self.budget:
            return origins
        self.measure(streams)
        parts = {s.layer: s.share or 0.0 for s in self._layer_shares()}
        least = max(MEMBER, self.noise)
        running = [k for k in self.stream_layers if layer_code_only(k) and own[k].top[0][1] == cls]
        kinds_part = {}
        for o in origins:
            if o.component:
                kinds_part[o.layer] = kinds_part.get(o.layer, 0.0) + o.share
        faulty = [k for k in running if parts.get(k, 0.0) - kinds_part.get(k, 0.0) >= least]
        if len(faulty) < 2 or not {o.layer for o in unexplained} <= set(faulty):
            return origins
        origins = [o for o in origins if o.layer not in faulty or not o.component]
        where, every = self._where(LAYER, faulty)
        explained = self.E(self._replaced(origins))
        self.systematic = LayerCode(LAYER, faulty, [self.streams[k].capture_name for k in faulty], where, every,
                                    explained, [parts[k] for k in faulty], [parts[k] for k in faulty], explained,
                                    own[faulty[0]].words(), cls, list(self.kinds), self.streams[faulty[0]].module_name,
                                    running)
        found = {o.layer for o in unexplained}
        return origins + [Origin(k, parts[k], None, None, [c.kind for c in self._kinds(k)],
                                 outside=self._outside_words(k)) for k in faulty if k not in found]

    def _beside_systematic(self, fixed: list[str], others: list[Origin], wide: list[str]) -> list[Origin]:
        """The origins of other kinds that stand beside a systematic fault whose faulty layers' components are
        ``fixed`` (its kind replaced in every layer holding it: ``wide``), each attributed again with that fault
        replaced beside it.

        One stays when leaving it out of ``wide`` (measured by the kind's first round) leaves a significant part, or,
        where that hides it, out of ``fixed`` and the others replaced together: in the origin's own layer the kind
        may lie downstream of it, as the routing lies downstream of its block's router. When its layer was attributed
        while the systematic fault still acted in it or upstream of it (in layers the search had not reached yet),
        the layer's part held some of that fault's error too, which a later kind of the layer carries and its own
        kind does not (the MoE block named for its router); with the fault replaced the part is its own, and the
        earliest kind explaining it is the origin. A fault acting only downstream acts alike with the layer's stream
        and its kinds replaced: the attribution stands."""
        names = [o.component for o in others]
        together = fixed + names

        def leaves(name, replaced):  # what leaving ``name`` out of ``replaced`` leaves
            return self.E(replaced) - self.E([n for n in replaced if n != name])

        hidden = [n for n in names if leaves(n, wide) < self.significant]
        self.measure([together] + [[n for n in together if n != name] for name in hidden])
        kept = [o for o in others if o.component not in hidden or leaves(o.component, together) >= self.significant]
        out = []
        for layer in dict.fromkeys(o.layer for o in kept):
            here = [o for o in kept if o.layer == layer]
            base = fixed + [o.component for o in kept if o.layer != layer]
            if {n for n in fixed if self.layer_of[n] <= layer} <= set().union(*(o.beside for o in here)):
                out += here  # attributed with the fault in it and upstream replaced beside already
                continue
            again = self._attribute(base, layer)
            out += again if all(o.component for o in again) else here
        return out

    def _where(self, kind: str, layers: list[int]) -> tuple[str, bool]:
        """``layers`` in the words of the model's layer groups ("every layer", "every MoE layer", "every sliding
        attention layer"), and whether they are one; else listed ("layers 1 and 3 (2 of 8)")."""
        groups = {"every layer": self.layers}
        moe = sorted({c.layer for c in self.components if c.kind == ROUTER and c.layer is not None})
        groups.setdefault("every MoE layer", moe)
        for name in dict.fromkeys(self.layer_types or []):
            groups.setdefault(f"every {name.replace('_', ' ')} layer",
                              [k for k, t in enumerate(self.layer_types) if t == name])
        holding = sorted({c.layer for c in self.components if c.kind == kind and c.layer is not None})
        groups.setdefault(f"every layer holding its {kind}", holding)
        for name, group in groups.items():
            if list(group) == layers:
                return name, True
        listed = ", ".join(map(str, layers[:-1])) + f" and {layers[-1]}"
        return f"layers {listed} ({len(layers)} of {len(self.layers)})", False


def _neighbours(names: list[str]) -> list[list[str]]:
    """``names`` (in layer order) in at most LEAVE_OUT groups of neighbours, as even as they come."""
    count = min(len(names), LEAVE_OUT)
    return [names[i * len(names) // count:(i + 1) * len(names) // count] for i in range(count)]
