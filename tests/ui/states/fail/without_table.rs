// The table of transitions is what the derive is for.
#[derive(Debug, Clone, PartialEq, idem::States)]
enum OrderStatus {
    Pending,
    Paid,
}

fn main() {}
