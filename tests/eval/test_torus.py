"""eval.torus: coordinates, neighbours, dimension-order routes and the snake ring of a torus or
mesh (pure functions the emulation and the cost model's topologies share; building a torus
needs root and is exercised by `python -m eval.torus`)."""
import pytest

from eval import torus
from eval.bench_collective import split_method


def test_coordinates_round_trip_row_major():
    dims = (2, 3, 4)
    for i in range(24):
        assert torus.index(torus.coords(i, dims), dims) == i
    assert torus.coords(5, (2, 3)) == (1, 2)


def test_a_2x2_torus_has_one_link_per_axis_and_a_diagonal_is_two_hops():
    dims = (2, 2)
    assert torus.links(dims) == [(0, 1), (0, 2), (1, 3), (2, 3)]
    assert sorted(torus.neighbours(0, dims)) == [1, 2]
    assert torus.hops(0, 3, dims) == 2 and torus.hops(0, 1, dims) == 1
    assert torus.next_hop(0, 3, dims) == 2  # first differing axis first


def test_a_route_is_its_hops_and_a_mesh_goes_along_the_line():
    assert torus.route(0, 3, (2, 2)) == [(0, 2), (2, 3)]
    assert all(len(torus.route(a, b, (4, 4))) == torus.hops(a, b, (4, 4))
               for a in range(16) for b in range(16))
    assert torus.route(0, 3, (4,)) == [(0, 3)]  # round the end
    assert torus.route(0, 3, (4,), wrap=False) == [(0, 1), (1, 2), (2, 3)]
    assert torus.route(0, 1, (2,), wrap=False) == [(0, 1)]


def test_routes_take_the_shorter_way_round():
    dims = (8,)
    assert torus.next_hop(0, 7, dims) == 7 and torus.hops(0, 7, dims) == 1
    assert torus.hops(0, 4, dims) == 4 and torus.hops(1, 6, dims) == 3
    assert len(torus.links((4, 4))) == 32  # 4 links per node, each shared by two


@pytest.mark.parametrize("dims", [(2, 2), (2, 4), (4, 4), (2, 2, 2), (4, 4, 4)])
def test_the_snake_ring_visits_every_node_through_neighbours(dims):
    order = torus.snake_order(dims)
    assert sorted(order) == list(range(len(order)))
    for a, b in zip(order, order[1:] + order[:1]):
        assert b in torus.neighbours(a, dims), (a, b)


def test_dimension_strings_and_method_suffixes():
    assert torus.parse_dims("2x4") == (2, 4) and torus.parse_dims("4") == (4,)
    with pytest.raises(ValueError):
        torus.parse_dims("2x0")
    assert split_method("int8:torus") == ("int8", "torus")
    assert split_method("bf16_ring") == ("bf16_ring", "ring")
    with pytest.raises(ValueError, match="mesh suffix"):
        split_method("int8:mesh")
