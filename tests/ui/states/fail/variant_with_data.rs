// A state is stored as its name: a variant cannot carry data.
#[derive(Debug, Clone, PartialEq, idem::States)]
#[states(Pending => [Paid])]
enum OrderStatus {
    Pending,
    Paid { amount: i64 },
}

fn main() {}
