// States are the variants of an enum.
#[derive(Debug, Clone, PartialEq, idem::States)]
#[states(Pending => Paid)]
struct OrderStatus {
    name: String,
}

fn main() {}
