"""Parameter names: wrapper components removed (canonical), classified into layer and module kind
(classify), re-aggregated per group with the series budget (grouping), and the layer columns of
the TensorBoard sink and the offline report (layers)."""
