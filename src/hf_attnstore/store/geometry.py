"""The shape of a session's KV: how many layers (KV slots), and the heads and head dim of keys and of values.

Most models cache keys and values of one shape, ``[1, kv_heads, n, head_dim]``: their geometry is the triple
``(layers, kv_heads, head_dim)``, as chunk files have always recorded it. Multi-head latent attention
(deepseek_v2/v3 and their kin) caches two tensors of different widths, a compressed latent and the rotary part
of the key: its geometry is ``(layers, key_heads, key_dim, value_heads, value_dim)``. The short form is kept
wherever the shapes agree, so files and fingerprints of the other models do not change.
"""

from __future__ import annotations

Geometry = tuple  # (layers, heads, dim) or (layers, key_heads, key_dim, value_heads, value_dim)


def make_geometry(layers: int, key_shape: tuple[int, int], value_shape: tuple[int, int]) -> Geometry:
    """The canonical geometry of `layers` slots with keys ``(heads, dim)`` `key_shape` and values `value_shape`.

    Example:
        >>> make_geometry(2, (4, 64), (4, 64)), make_geometry(2, (1, 576), (1, 512))
        ((2, 4, 64), (2, 1, 576, 1, 512))
    """
    key_shape, value_shape = tuple(int(x) for x in key_shape), tuple(int(x) for x in value_shape)
    if key_shape == value_shape:
        return (int(layers), *key_shape)
    return (int(layers), *key_shape, *value_shape)


def parse_geometry(values) -> Geometry:
    """A geometry from its recorded list (3 or 5 positive ints), canonical; ValueError otherwise.

    Example:
        >>> parse_geometry([2, 4, 64, 4, 64])
        (2, 4, 64)
    """
    g = tuple(int(x) for x in values)
    if len(g) not in (3, 5) or any(x <= 0 for x in g):
        raise ValueError(f"a KV geometry is 3 or 5 positive ints, got {list(values)!r}")
    return make_geometry(g[0], g[1:3], g[3:] if len(g) == 5 else g[1:3])


def shapes(geometry: Geometry) -> tuple[int, tuple[int, int], tuple[int, int]]:
    """``(layers, (key_heads, key_dim), (value_heads, value_dim))`` of a geometry.

    Example:
        >>> shapes((2, 4, 64))
        (2, (4, 64), (4, 64))
    """
    layers, key_shape = geometry[0], tuple(geometry[1:3])
    return layers, key_shape, (tuple(geometry[3:5]) if len(geometry) == 5 else key_shape)


def shape_of(geometry: Geometry, keys: bool) -> tuple[int, int]:
    """``(heads, dim)`` of the keys (`keys`) or of the values.

    Example:
        >>> shape_of((2, 1, 576, 1, 512), keys=False)
        (1, 512)
    """
    _, key_shape, value_shape = shapes(geometry)
    return key_shape if keys else value_shape


def bytes_per_token(geometry: Geometry, itemsize: int) -> int:
    """Bytes of one token's keys and values over every layer, at `itemsize` bytes per element.

    Example:
        >>> bytes_per_token((2, 4, 64), itemsize=2)  # 2 layers x (keys + values) x 4 heads x 64 x 2 bytes
        2048
    """
    layers, (kh, kd), (vh, vd) = shapes(geometry)
    return layers * (kh * kd + vh * vd) * itemsize
